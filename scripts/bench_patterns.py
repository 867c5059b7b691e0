"""Single-pattern CNN graphs (models/patterns.py) or ONNX files with souffle-py against ONNX Runtime, one row
each: latency medians (interleaved runs, souffle_py.benchmark.measure), ratio, outputs checked, compile time
with an empty tuning database (the compile-time measurements of schedule/variants.py included).

    python scripts/bench_patterns.py [NAME | FILE.onnx ...] [--repeat N]
"""

import argparse
import os
import sys
import tempfile

os.environ.setdefault("TVM_NUM_THREADS", "2")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import onnx  # noqa: E402

import souffle_py  # noqa: E402
from models.patterns import PATTERNS  # noqa: E402
from souffle_py.benchmark import measure  # noqa: E402


def _model(name: str) -> onnx.ModelProto:
    if name.endswith(".onnx"):
        return onnx.load(name)
    if name not in PATTERNS:
        raise SystemExit(f"unknown pattern {name!r}: one of {', '.join(PATTERNS)}, or a path to an .onnx file")
    return PATTERNS[name]()[0]


def main(argv) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("names", nargs="*", default=list(PATTERNS), help="pattern names or .onnx files")
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args(argv)
    print("| model | ONNX Runtime (ms) | souffle-py (ms) | ratio | matches | compile (s) |")
    print("|---|---:|---:|---:|:---:|---:|")
    ok = True
    for name in args.names:
        database = tempfile.mkdtemp(prefix="souffle-empty-")  # compile time with nothing cached
        rows = measure(_model(name), {"souffle-py": lambda p: souffle_py.optimize(p, quiet=True, database=database)},
                       repeat=args.repeat, log=lambda s: None)
        ort, ours = rows[0], rows[1]
        label = os.path.basename(name)
        if ours.error:
            print(f"| {label} | {ort.median_ms:.3f} | failed: {ours.error} | | | |", flush=True)
            ok = False
            continue
        ok &= bool(ours.matches)
        print(f"| {label} | {ort.median_ms:.3f} | {ours.median_ms:.3f} | {ours.median_ms / ort.median_ms:.2f}x | "
              f"{'yes' if ours.matches else 'NO'} | {ours.compile_s:.1f} |", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
