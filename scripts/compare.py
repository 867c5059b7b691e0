"""Shared command-line plumbing of the scripts: model overrides, the systems to compare, printing."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import typing

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

os.environ.setdefault("SOUFFLE_COMPILE_CACHE", "0")  # compile times are measured: every compile a real one
import souffle_py  # noqa: E402  (sets TVM_NUM_THREADS before TVM starts)
from models.registry import build_model, flag_type, load_module  # noqa: E402
from souffle_py.backends import backend_for  # noqa: E402
from souffle_py.baselines import openvino_systems  # noqa: E402
from souffle_py.benchmark import compute_floor, format_table, measure  # noqa: E402


def model_parser(name: str, description: str) -> argparse.ArgumentParser:
    """--tiny, --seed, --repeat and one flag per field of the model's Config."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--tiny", action="store_true", help="the tiny test configuration")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=10, help="timed runs (median reported)")
    parser.add_argument("--target", default="llvm", help="llvm (the host CPU, default), cuda, h100, h200, a100")
    parser.add_argument("--trials", type=int, default=0,
                        help="MetaSchedule trials (in total); the table then has souffle-py untuned and tuned")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"),
                        help="bf16: also souffle-py with bfloat16 GEMM and conv operands (float32 rows stay)")
    parser.add_argument("--database", default=None,
                        help="tuning database folder (default $SOUFFLE_CACHE/tuning or .souffle_cache/tuning)")
    config = load_module(name).Config
    hints = typing.get_type_hints(config)
    for field in dataclasses.fields(config):
        kind = flag_type(hints[field.name])
        if kind is not None:
            parser.add_argument(f"--{field.name.replace('_', '-')}", dest=field.name, type=kind, default=None,
                                help=f"model config (paper default {field.default})")
    return parser


def config_overrides(name: str, args) -> dict:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(load_module(name).Config)
            if getattr(args, f.name, None) is not None}


def compile_and_compare(name: str, args) -> int:
    """Build the model, compile it with souffle-py, check it against ONNX Runtime and print the table."""
    overrides = config_overrides(name, args)
    proto = build_model(name, tiny=args.tiny, seed=args.seed, **overrides)
    title = f"{name} ({'tiny' if args.tiny else 'paper'} config{', ' if overrides else ''}" \
            f"{', '.join(f'{k}={v}' for k, v in overrides.items())}){'' if args.target == 'llvm' else ', ' + args.target}"
    print(f"{title}: {len(proto.graph.node)} ONNX nodes")
    if not device_present(args.target):
        return compile_only(proto, args.target)
    systems = {"souffle-py": lambda p: souffle_py.optimize(p, target=args.target)}
    if args.trials > 0:  # untuned: no database at all, not even the default one
        untuned = tempfile.mkdtemp(prefix="souffle-untuned-")
        systems["souffle-py"] = lambda p: souffle_py.optimize(p, target=args.target, database=untuned)
        systems[f"souffle-py ({args.trials} trials)"] = lambda p: souffle_py.optimize(
            p, target=args.target, trials=args.trials, database=args.database)
    reduced = []
    if args.precision != "fp32":
        name = f"souffle-py {args.precision}"
        systems[name] = lambda p: souffle_py.optimize(p, target=args.target, precision=args.precision)
        reduced.append(name)
    if args.target == "llvm":  # OpenVINO's f32 hint and its default (bf16 here), when it is installed
        ov_systems = openvino_systems()
        systems.update(ov_systems)
        reduced += [name for name in ov_systems if "default" in name]
    rows = measure(proto, systems, repeat=args.repeat, reduced=reduced)
    print(format_table(title, rows))
    print(precision_summary(rows))
    floor = compute_floor(rows, backend_for(args.target).peak_gflops)
    if floor:
        print("\n" + floor)
    return 0 if all(r.matches is not False for r in rows) else 1


def precision_summary(rows) -> str:
    """The reduced-precision rows against souffle-py fp32 and OpenVINO's default: latency ratios and the
    output errors (max abs and relative to the largest output) side by side."""
    by_name = {r.system: r for r in rows if not r.error}
    lines = []
    for r in rows:
        if r.error or r.precision == "fp32" or r.system not in by_name or not r.system.startswith("souffle-py"):
            continue
        for other in ("souffle-py", "OpenVINO default"):
            if other in by_name:
                o = by_name[other]
                lines.append(f"{r.system} / {other}: {r.median_ms / o.median_ms:.2f}x latency; max abs error "
                             f"{r.max_abs_diff:.3g} vs {o.max_abs_diff:.3g} (relative {r.max_rel_diff:.3g} vs "
                             f"{o.max_rel_diff:.3g})")
    return "\n".join(lines)


def device_present(target: str) -> bool:
    """Whether this machine can run what `target` compiles for (a GPU target needs a GPU)."""
    from souffle_py.backends.cuda.specs import gpu_present

    return backend_for(target).device == "cpu" or gpu_present()


def compile_only(proto, target: str) -> int:
    """Without the target's device: compile, print the kernels and say that timing needs the device."""
    model = souffle_py.optimize(proto, target=target)
    print(model.describe())
    print(f"compiled in {model.compile_seconds:.1f}s: {model.num_kernels} kernel launches, {model.grid_syncs} grid "
          f"syncs per inference; no GPU here, so nothing is run or timed (export it with souffle compile -o and "
          f"run it on a GPU machine)")
    return 0
