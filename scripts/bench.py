"""Benchmark souffle-py against its baselines, side by side in one run: median latency, ratio to ONNX
Runtime, kernel calls, and an output check against ONNX Runtime for every system.

    python scripts/bench.py --tiny                 # what `make demo` runs: tiny BERT and tiny LSTM
    python scripts/bench.py --models bert lstm     # BERT-base (seq 128) and the 10x100 LSTM
    python scripts/bench.py --tiny --output docs/benchmarks.md
    python scripts/bench.py --models bert --trials 400   # souffle-py and TVM Relax, same tuning budget

TVM Relax (relax.frontend.onnx + its default pipeline with FuseOps/FuseTIR) gets the same MetaSchedule
trial budget as souffle-py; each system tunes into its own database folder under --database.
"""

import argparse
import platform
import sys
import time

from compare import build_model, format_table, measure, souffle_py  # noqa: F401  (sets up sys.path first)
from souffle_py.baselines import relax_tvm, unfused_tvm

# name -> (model, overrides); the tiny set is for `make demo` and CI-sized checks
MODELS = {
    "bert": ("bert", {}),
    "bert-layernorm-op": ("bert", {"layernorm": "op"}),
    "lstm": ("lstm", {}),
    "lstm-unrolled": ("lstm", {"spelling": "unrolled"}),
    "sbert": ("sbert", {}),
}



def systems(trials: int, database: str) -> dict:
    """The compared systems; both tuned ones get `trials` MetaSchedule trials."""
    return {
        "souffle-py": lambda proto: souffle_py.optimize(proto, trials=trials, database=f"{database}/souffle",
                                                        quiet=True),
        "unfused TVM": unfused_tvm,
        f"TVM Relax (FuseOps/FuseTIR, {trials} trials)": lambda proto: relax_tvm(
            proto, trials=trials, database_dir=f"{database}/relax", quiet=True),
    }

# The paper's ablation (Table 4): each row adds one step to the previous one.
ABLATION = {
    "V0: no transforms (every TE a kernel)": lambda proto: souffle_py.optimize(proto, passes="V0", merge=False),
    "V1: + horizontal": lambda proto: souffle_py.optimize(proto, passes="V1", merge=False),
    "V2: + vertical": lambda proto: souffle_py.optimize(proto, passes="V2", merge=False),
    "V3: + partition and merging": lambda proto: souffle_py.optimize(proto, passes="V2", merge=True),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["bert", "lstm"], choices=sorted(MODELS))
    parser.add_argument("--tiny", action="store_true", help="tiny configurations (seconds, for the demo)")
    parser.add_argument("--repeat", type=int, default=10, help="timed runs per system (median reported)")
    parser.add_argument("--ablation", action="store_true", help="also the paper's ablation rows (V0..V3)")
    parser.add_argument("--trials", type=int, default=0, help="MetaSchedule trials for souffle-py and TVM Relax")
    parser.add_argument("--database", default=".souffle_cache/bench", help="tuning databases (per system)")
    parser.add_argument("--no-relax", action="store_true", help="skip TVM Relax (untuned it is very slow on "
                                                                "full-size models: ~20 s per BERT-base run)")
    parser.add_argument("--output", help="append the tables (and the command) to this markdown file")
    args = parser.parse_args(argv)

    tables, all_match = [], True
    for key in args.models:
        name, overrides = MODELS[key]
        proto = build_model(name, tiny=args.tiny, **overrides)
        title = f"{key} ({'tiny' if args.tiny else 'paper'} configuration)"
        print(f"{title}: {len(proto.graph.node)} ONNX nodes", flush=True)
        compared = systems(args.trials, args.database)
        if args.no_relax:
            compared = {k: v for k, v in compared.items() if not k.startswith("TVM Relax")}
        runs = [(title, compared)] + ([(f"{title}, ablation", ABLATION)] if args.ablation else [])
        for table_title, table_systems in runs:
            rows = measure(proto, table_systems, repeat=args.repeat)
            all_match &= all(r.matches is not False for r in rows)
            tables.append(format_table(table_title, rows))
            print(tables[-1] + "\n", flush=True)
    if args.output:
        with open(args.output, "a") as out:
            out.write(f"\n## {time.strftime('%Y-%m-%d')} — `python scripts/bench.py {' '.join(argv or sys.argv[1:])}`\n\n"
                      f"Machine: {platform.machine()}, {platform.processor() or 'cpu'}, "
                      f"TVM_NUM_THREADS={souffle_py.target.num_threads()}, ONNX Runtime with the same thread count.\n\n")
            out.write("\n\n".join(tables) + "\n")
    if not all_match:
        print("ERROR: some system's outputs do not match ONNX Runtime", file=sys.stderr)
    return 0 if all_match else 1


if __name__ == "__main__":
    sys.exit(main())
