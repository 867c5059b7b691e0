"""The `souffle` command line: `souffle compile model.onnx`, and one subcommand per pipeline tool.

Each subcommand is a `_cmd_*` function registered in `COMMANDS` with its argument setup, so adding one
touches only this table.
"""

from __future__ import annotations

import argparse
import logging
import sys

from souffle_py.errors import ShapeError, SouffleError


TARGET_HELP = ("llvm (the host CPU, default); another CPU by short name: avx2 (x86-64-v3), avx512 (x86-64-v4), "
               "znver4, graviton2, graviton3, grace, apple-m1 (Arm: compiled and linked here, run there; "
               "docs/targets.md); 'llvm -mcpu=haswell' or a TVM target's JSON; cuda (the present NVIDIA GPU, "
               "else an H100-class sm_90), h100, h200, a100")


def _parse_shapes(items):
    """['x=1,128,768', ...] -> {'x': (1, 128, 768)}."""
    shapes = {}
    for item in items or []:
        name, _, dims = item.partition("=")
        try:
            shape = tuple(int(d) for d in dims.split(","))
        except ValueError:
            shape = ()
        if not name or not shape or any(d < 1 for d in shape):
            raise ShapeError(f"--input-shape expects NAME=D0,D1,... with positive dimensions, got '{item}'")
        shapes[name] = shape
    return shapes


def _parse_dynamic(items):
    """['input_ids:1=1..512', 'batch=1..8'] -> {'input_ids': {1: (1, 512)}, 'batch': (1, 8)}."""
    from souffle_py.errors import DynamicShapeError

    spec = {}
    for item in items or []:
        where, _, bounds = item.partition("=")
        low, dots, high = bounds.partition("..")
        name, colon, axis = where.partition(":")
        try:
            bounds = (int(low), int(high) if dots else int(low))
            axis = int(axis) if colon else None
        except ValueError:
            name = ""
        if not name or (colon and axis is None):
            raise DynamicShapeError(f"--dynamic expects INPUT:AXIS=MIN..MAX or SYMBOL=MIN..MAX (e.g. "
                                    f"input_ids:1=1..512, sequence=1..512), got '{item}'")
        if colon:
            spec.setdefault(name, {})[axis] = bounds
        else:
            spec[name] = bounds
    return spec


def _parse_precompile(items):
    """['min', 'batch=1,sequence=128'] -> ['min', {'batch': 1, 'sequence': 128}]."""
    shapes = []
    for item in items or []:
        if item in ("min", "max", "none"):
            shapes.append(item)
            continue
        try:
            shapes.append({k: int(v) for k, _, v in (part.partition("=") for part in item.split(","))})
        except ValueError:
            raise ShapeError(f"--precompile expects min, max, none or SYMBOL=N,SYMBOL=N..., got '{item}'") from None
    return shapes or None


def _add_model_args(parser):
    parser.add_argument("model", help="path of the ONNX model")
    parser.add_argument("--input-shape", action="append", metavar="NAME=D0,D1,...",
                        help="concrete shape for an input with symbolic dimensions (repeatable)")


def _add_rpc_args(parser):
    parser.add_argument("--rpc-tracker", metavar="HOST:PORT",
                        help="measure tuning candidates on the servers of this TVM RPC tracker (built here)")
    parser.add_argument("--rpc-key", metavar="KEY", help="the device key the tracker's servers registered with")


def _runner(args):
    """The RpcTracker of --rpc-tracker/--rpc-key, or None (measure on this machine)."""
    if args.rpc_tracker is None:
        if args.rpc_key is not None:
            raise SouffleError("--rpc-key needs --rpc-tracker HOST:PORT")
        return None
    from souffle_py.schedule.runners import RpcTracker

    return RpcTracker.parse(args.rpc_tracker, args.rpc_key)


def _setup_compile(parser):
    _add_model_args(parser)
    parser.add_argument("--target", default="llvm", help=TARGET_HELP)
    parser.add_argument("-o", "--output", metavar="MODEL.tar",
                        help="export the compiled model to one file (souffle_py.load() runs it; a cuda model "
                             "compiled here runs on a GPU machine without nvcc)")
    parser.add_argument("--passes", default="all", help="the target's passes: all (default), none/V0, V1, V2, "
                                                         "names or groups (vertical,horizontal), -name to drop "
                                                         "one; `souffle passes` lists them")
    parser.add_argument("--no-merge", action="store_true", help="every TE its own kernel (unfused)")
    parser.add_argument("--database", help="tuning database folder (default: $SOUFFLE_CACHE/tuning, "
                                           "else .souffle_cache/tuning)")
    parser.add_argument("--benchmark", action="store_true", help="also time inference (random inputs)")
    parser.add_argument("--profile", action="store_true",
                        help="also time each kernel call (random inputs), within inferences and alone, and print "
                             "the slowest first, with its GFLOP/s and (CPU) its share of the measured FMA peak")
    parser.add_argument("--stages", action="store_true",
                        help="with --profile (CPU): under each kernel call, its slowest stages timed inside it, with "
                             "their ONNX nodes, schedule rule and share of the peak")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"),
                        help="fp32 (exact, default), bf16 or fp16 (CUDA only): GEMM (CPU: and conv) operands in "
                             "bfloat16 / float16, float32 accumulation (CUDA: tensor cores)")
    parser.add_argument("--int8", default="exact", choices=("exact", "saturating"),
                        help="int8 GEMMs and convs on x86 without VNNI: exact (default, two vpmaddwd) or saturating "
                             "(vpmaddubsw, as ONNX Runtime's and OpenVINO's AVX2 kernels, where activations are ReLU-like "
                             "or dynamically quantized; faster)")
    parser.add_argument("--exact-math", action="store_true",
                        help="libm's exp/erf/tanh/sigmoid instead of the fast vectorizable approximations")
    parser.add_argument("--trials", type=int, default=0,
                        help="MetaSchedule trials, in total, for kernels without a record (default 0: none)")
    parser.add_argument("--no-cache", action="store_true",
                        help="compile even if the compile cache holds this model ($SOUFFLE_CACHE/models)")
    parser.add_argument("--dynamic", action="append", metavar="INPUT:AXIS=MIN..MAX",
                        help="a dimension that varies at run time (repeatable): INPUT:AXIS=MIN..MAX, or a symbolic "
                             "dimension of the ONNX graph by name, SYMBOL=MIN..MAX (e.g. sequence=1..512); each shape "
                             "is compiled exactly on first use, and -o exports all compiled shapes with the model")
    parser.add_argument("--precompile", action="append", metavar="SHAPE",
                        help="with --dynamic, shapes to compile now (repeatable): min (default), max, none or "
                             "SYMBOL=N,SYMBOL=N")
    parser.add_argument("--fallback", choices=("onnxruntime",),
                        help="with --dynamic, serve a new shape at once in ONNX Runtime while it compiles in the "
                             "background (recorded in the -o file)")
    _add_rpc_args(parser)


def _cmd_compile(args) -> int:
    import souffle_py
    from souffle_py.backends import backend_for

    if args.dynamic:
        return _compile_dynamic(args)
    if args.precompile or args.fallback:
        raise ShapeError("--precompile and --fallback concern a model with dynamic dimensions: give --dynamic too")

    model = souffle_py.optimize(args.model, target=args.target, input_shapes=_parse_shapes(args.input_shape),
                                passes=args.passes, merge=not args.no_merge, database=args.database,
                                fast_math=not args.exact_math, precision=args.precision, int8=args.int8,
                                trials=args.trials, runner=_runner(args),
                                cache=False if args.no_cache or args.stages else None)
    print(model.describe())
    if model.plan.device == "cuda":
        from souffle_py.backends.cuda.report import grid_figures
        figures = grid_figures(model.plan)
        print("\n".join([f"CUDA: {figures.line()}", *figures.fallback_lines()]))
    print(f"{'loaded from the compile cache' if model.cached else 'compiled'} in {model.compile_seconds:.1f}s")
    if args.output:
        model.export(args.output)
        print(f"wrote {args.output}")
    if args.benchmark:
        print(f"latency: {model.benchmark()['median_ms']:.2f} ms (median)")
    if args.profile:
        rows = model.profile(stages=args.stages)
        print("measuring the target's peak ...", file=sys.stderr, flush=True)
        print(model.format_profile(rows, top=20, peak_gflops=backend_for(args.target).peak_gflops(model.single_threaded, model.plan.precision)))
    return 0


def _compile_dynamic(args) -> int:
    """`souffle compile --dynamic ...`: a DynamicModel with its precompiled shapes."""
    import souffle_py

    if args.input_shape or args.profile or args.trials:
        raise ShapeError("--dynamic does not combine with --input-shape, --profile or --trials (fix a dimension "
                         "with --dynamic NAME=N..N)")
    model = souffle_py.optimize(args.model, target=args.target, dynamic=_parse_dynamic(args.dynamic),
                                precompile=_parse_precompile(args.precompile), fallback=args.fallback,
                                passes=args.passes,
                                merge=not args.no_merge, database=args.database, fast_math=not args.exact_math,
                                precision=args.precision, int8=args.int8, cache=False if args.no_cache else None)
    print(model.describe())
    print(f"{'loaded from the compile cache' if model.cached else 'compiled'} in {model.compile_seconds:.1f}s")
    if args.output:
        model.export(args.output)
        print(f"wrote {args.output}")
    if args.benchmark:
        for shape in model.specialised_shapes:
            result = model.benchmark(model.random_feeds(shape=shape))
            where = ", ".join(f"{k}={v}" for k, v in shape.items())
            print(f"latency at {where}: {result['median_ms']:.2f} ms (median)")
    return 0


def _setup_tune(parser):
    _add_model_args(parser)
    parser.add_argument("--target", default="llvm", help=TARGET_HELP)
    parser.add_argument("--trials", type=int, required=True, help="MetaSchedule trials, in total over all kernels")
    parser.add_argument("--no-merge", action="store_true",
                        help="tune the unfused kernels (the default tunes the compute stages of the merged ones)")
    parser.add_argument("--database", help="tuning database folder (default: $SOUFFLE_CACHE/tuning, "
                                           "else .souffle_cache/tuning)")
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    _add_rpc_args(parser)


def _cmd_tune(args) -> int:
    """Tune exactly the kernels `optimize()` builds for this model, so the next compile finds them."""
    import souffle_py

    model = souffle_py.optimize(args.model, target=args.target, input_shapes=_parse_shapes(args.input_shape),
                                trials=args.trials, database=args.database, quiet=args.quiet,
                                merge=not args.no_merge, runner=_runner(args))
    print(f"{model.num_kernels} kernel calls ({model.distinct_kernels} distinct); compiled and tuned in "
          f"{model.compile_seconds:.0f}s")
    return 0


def _setup_analyze(parser):
    _add_model_args(parser)
    parser.add_argument("--json", metavar="OUT.json", help="also write the full analysis (every TE, map, reuse set)")
    parser.add_argument("--top", type=int, default=5, metavar="N", help="reuse sets listed in the summary (default 5)")
    parser.add_argument("--passes", metavar="SPEC", nargs="?", const="all",
                        help="also run the TE transformations and print the TE counts before and after each pass: "
                             "all (the default when given without SPEC), none, V0, V1, V2 (the paper's ablation) "
                             "or a list such as vertical,horizontal")


def _cmd_analyze(args) -> int:
    import json
    import time

    from souffle_py.frontend import import_onnx
    from souffle_py.ir.analysis import analyze, summary, to_json
    from souffle_py.passes import conv_weights_blocked, select, transformed
    from souffle_py.passes.transformations import TRANSFORMATIONS

    enabled = select(args.passes, TRANSFORMATIONS) if args.passes else None  # a bad spec fails before loading
    start = time.perf_counter()
    program = conv_weights_blocked(import_onnx(args.model, _parse_shapes(args.input_shape)))
    loaded = time.perf_counter()
    analysis = analyze(program)
    done = time.perf_counter()
    print(summary(analysis, top=args.top))
    if args.json:
        try:
            with open(args.json, "w") as f:
                json.dump(to_json(analysis), f, indent=1)
        except OSError as exc:
            raise SouffleError(f"cannot write {args.json}: {exc}") from exc
        print(f"wrote {args.json}")
    print(f"loaded in {loaded - start:.1f}s, analyzed in {done - loaded:.1f}s")
    if enabled is not None:
        _, records = transformed(program, args.passes)
        names = [p.name for p in TRANSFORMATIONS if p.name in enabled]
        print(f"\nTE transformations ({args.passes}: {', '.join(names) or 'no pass'}):")
        print(f"  {'pass':<12}{'TEs before':>11}{'TEs after':>11}{'seconds':>9}  what it did")
        for r in records:
            print(f"  {r.name:<12}{r.tes_before:>11}{r.tes_after:>11}{r.seconds:>9.2f}  {r.summary}")
        print(f"  {len(program.stages)} TEs -> {records[-1].tes_after if records else len(program.stages)} TEs")
    return 0


def _setup_passes(parser):
    parser.add_argument("--target", default="llvm", help=TARGET_HELP)
    parser.add_argument("--passes", default="all", help="show which of them this selection enables")


def _cmd_passes(args) -> int:
    """The target's registered passes in their order, with group, facts and what each does."""
    from souffle_py.backends import backend_for
    from souffle_py.passes import passes_for, select

    steps = passes_for(backend_for(args.target).device)
    enabled = select(args.passes, steps)
    print(f"{'on':<4}{'pass':<30}{'group':<13}what it does")
    for p in steps:
        facts = "".join([f" (needs {', '.join(p.requires)})" if p.requires else "",
                         f" (gives {', '.join(p.provides)})" if p.provides else "",
                         " (merged kernels only)" if p.merged_only else ""])
        print(f"{'yes' if p.name in enabled else '-':<4}{p.name:<30}{p.group:<13}{p.doc}{facts}")
    return 0


def _setup_cache(parser):
    parser.add_argument("action", choices=("ls", "clear"), help="ls: the compiled models stored; clear: remove them")


def _cmd_cache(args) -> int:
    from souffle_py import compile_cache

    if args.action == "ls":
        print(compile_cache.describe_entries())
    else:
        print(f"removed {compile_cache.clear()} compiled models from {compile_cache.folder()}")
    return 0


COMMANDS = {
    "compile": (_setup_compile, _cmd_compile, "compile a model and list its kernels"),
    "tune": (_setup_tune, _cmd_tune, "tune a model's compute-intensive kernels into the tuning database"),
    "analyze": (_setup_analyze, _cmd_analyze, "two-level TE analysis: CI/MI, dependence maps, reuse, memory"),
    "cache": (_setup_cache, _cmd_cache, "the compile cache: list or clear the compiled models it holds"),
    "passes": (_setup_passes, _cmd_passes, "the target's registered passes, in order, and which --passes enables"),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="souffle", description="souffle-py: whole-model DNN optimizer")
    parser.add_argument("-v", "--verbose", action="store_true", help="progress output")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (setup, _, help_text) in COMMANDS.items():
        setup(sub.add_parser(name, help=help_text))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        return COMMANDS[args.command][1](args)
    except SouffleError as exc:
        print(f"souffle: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
