"""Benchmark souffle-py against its baselines, side by side in one run: median latency, ratio to ONNX
Runtime, kernel calls, and an output check against ONNX Runtime for every system.

    python scripts/bench.py --tiny                 # what `make demo` runs: tiny BERT and tiny LSTM
    python scripts/bench.py --models bert lstm     # BERT-base (seq 128) and the 10x100 LSTM
    python scripts/bench.py --tiny --output docs/benchmarks.md
    python scripts/bench.py --models bert --trials 400   # souffle-py and TVM Relax, same tuning budget
    python scripts/bench.py --target cuda --models bert lstm-unrolled resnext efficientnet swin mmoe

CPU: TVM Relax (relax.frontend.onnx + its default pipeline with FuseOps/FuseTIR) gets the same MetaSchedule
trial budget as souffle-py; each system tunes into its own database folder under --database.
CUDA: souffle-py, unfused TVM on the GPU (same schedules), TVM Relax's CUDA pipeline (dlight) with and
without its CUDA-graph option, and, when PyTorch is importable, the torch.nn equivalent of the model in
eager mode, captured in a CUDA graph and under torch.compile(mode="reduce-overhead"). Every system's
outputs are checked against ONNX Runtime on the CPU; GPU rows report absolute device times and their
ratio to TVM Relax + dlight.
"""

import argparse
import platform
import sys
import time

from compare import (backend_for, build_model, compute_floor, device_present, format_table, measure,  # noqa: F401
                     souffle_py)  # (compare sets up sys.path first)
from souffle_py.baselines import openvino_systems, relax_tvm, unfused_tvm
from souffle_py.host import num_threads

# name -> (model, overrides); the tiny set is for `make demo` and CI-sized checks
MODELS = {
    "bert": ("bert", {}),
    "bert-layernorm-op": ("bert", {"layernorm": "op"}),
    "lstm": ("lstm", {}),
    "lstm-unrolled": ("lstm", {"spelling": "unrolled"}),
    "gru": ("gru", {}),
    "bilstm": ("bilstm", {}),
    "resnext": ("resnext", {}),
    "efficientnet": ("efficientnet", {}),
    "swin": ("swin", {}),
    "mmoe": ("mmoe", {}),
    "sbert": ("sbert", {}),
}
RELAX_DLIGHT = "TVM Relax + dlight"



def systems(trials: int, database: str, target: str = "llvm", precision: str = "fp32") -> dict:
    """The compared systems; on the CPU both tuned ones get `trials` MetaSchedule trials, and with
    `precision` bf16 also souffle-py in bf16; OpenVINO's f32 and default rows when it is installed."""
    if target != "llvm":
        return gpu_systems(trials, database, target)
    reduced = {f"souffle-py {precision}": lambda proto: souffle_py.optimize(
        proto, trials=trials, database=f"{database}/souffle", quiet=True, precision=precision)} \
        if precision != "fp32" else {}
    return {
        "souffle-py": lambda proto: souffle_py.optimize(proto, trials=trials, database=f"{database}/souffle",
                                                        quiet=True),
        **reduced,
        **openvino_systems(),
        "unfused TVM": unfused_tvm,
        f"TVM Relax (FuseOps/FuseTIR, {trials} trials)": lambda proto: relax_tvm(
            proto, trials=trials, database_dir=f"{database}/relax", quiet=True),
    }

def gpu_systems(trials: int, database: str, target: str) -> dict:
    """souffle-py, unfused TVM, TVM Relax + dlight (with and without CUDA graphs) and PyTorch if present."""
    compared = {
        "souffle-py": lambda proto: souffle_py.optimize(proto, target=target, trials=trials,
                                                        database=f"{database}/souffle", quiet=True),
        "unfused TVM": lambda proto: unfused_tvm(proto, target),
        RELAX_DLIGHT: lambda proto: relax_tvm(proto, target),
        f"{RELAX_DLIGHT}, CUDA graph": lambda proto: relax_tvm(proto, target, cuda_graph=True),
    }
    from souffle_py.baselines_torch import torch_available, torch_systems

    if torch_available():
        compared.update(torch_systems())
    return compared


def ablation(target: str) -> dict:
    """The paper's ablation (Table 4): each row adds one step to the previous one; on a GPU also V3's
    stages launched as separate kernels (what the grid synchronization saves)."""
    def compile_with(passes, merge, grid_sync=True):
        return lambda proto: souffle_py.optimize(proto, target=target, passes=passes, merge=merge,
                                                 grid_sync=grid_sync)

    rows = {
        "V0: no transforms (every TE a kernel)": compile_with("V0", False),
        "V1: + horizontal": compile_with("V1", False),
        "V2: + vertical": compile_with("V2", False),
        "V3: + partition and merging": compile_with("V2", True),
    }
    if target != "llvm":
        rows["V3's stages as separate kernels (no grid sync)"] = compile_with("V2", True, grid_sync=False)
    return rows


def gpu_line(target: str) -> str:
    if target == "llvm":
        return ""
    from souffle_py.backends import backend_for

    return f"; GPU: {backend_for(target).describe()}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["bert", "lstm"], choices=sorted(MODELS))
    parser.add_argument("--target", default="llvm", help="llvm (the host CPU, default), cuda, h100, h200, a100")
    parser.add_argument("--tiny", action="store_true", help="tiny configurations (seconds, for the demo)")
    parser.add_argument("--repeat", type=int, default=10, help="timed runs per system (median reported)")
    parser.add_argument("--ablation", action="store_true", help="also the paper's ablation rows (V0..V3)")
    parser.add_argument("--trials", type=int, default=0, help="MetaSchedule trials for souffle-py and TVM Relax")
    parser.add_argument("--database", default=".souffle_cache/bench", help="tuning databases (per system)")
    parser.add_argument("--no-relax", action="store_true", help="skip TVM Relax (untuned it is very slow on "
                                                                "full-size models: ~20 s per BERT-base run)")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"),
                        help="bf16: also a souffle-py row with bfloat16 GEMM operands")
    parser.add_argument("--output", help="append the tables (and the command) to this markdown file")
    args = parser.parse_args(argv)
    if not device_present(args.target):
        print(f"bench.py --target {args.target} measures on a GPU and this machine has none; "
              "scripts/compile_model.py NAME --target cuda compiles and describes without one", file=sys.stderr)
        return 2

    tables, all_match = [], True
    peak_gflops = backend_for(args.target).peak_gflops  # the roof the souffle-py rows are rated against (CPU)
    for key in args.models:
        name, overrides = MODELS[key]
        proto = build_model(name, tiny=args.tiny, **overrides)
        title = f"{key} ({'tiny' if args.tiny else 'paper'} configuration)"
        print(f"{title}: {len(proto.graph.node)} ONNX nodes", flush=True)
        compared = systems(args.trials, args.database, args.target, args.precision)
        if args.no_relax:
            compared = {k: v for k, v in compared.items() if not k.startswith("TVM Relax")}
        runs = [(title, compared)] + ([(f"{title}, ablation", ablation(args.target))] if args.ablation else [])
        gpu = args.target != "llvm"
        for table_title, table_systems in runs:
            rows = measure(proto, table_systems, repeat=args.repeat,
                           reduced=[s for s in table_systems if s.endswith("bf16") or s == "OpenVINO default"])
            all_match &= all(r.matches is not False for r in rows)
            reference = RELAX_DLIGHT if gpu and any(r.system == RELAX_DLIGHT and not r.error for r in rows) else None
            tables.append(format_table(f"{table_title}, {args.target}" if gpu else table_title, rows, reference))
            floor = compute_floor(rows, peak_gflops)
            if floor:
                tables[-1] += "\n\n" + floor
            print(tables[-1] + "\n", flush=True)
    if args.output:
        with open(args.output, "a") as out:
            out.write(f"\n## {time.strftime('%Y-%m-%d')} — `python scripts/bench.py {' '.join(argv or sys.argv[1:])}`\n\n"
                      f"Machine: {platform.machine()}, {platform.processor() or 'cpu'}, "
                      f"TVM_NUM_THREADS={num_threads()}, ONNX Runtime with the same thread count"
                      f"{gpu_line(args.target)}.\n\n")
            out.write("\n\n".join(tables) + "\n")
    if not all_match:
        print("ERROR: some system's outputs do not match ONNX Runtime", file=sys.stderr)
    return 0 if all_match else 1


if __name__ == "__main__":
    sys.exit(main())
