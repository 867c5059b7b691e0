"""Single-pattern CNN graphs (models/patterns.py) with souffle-py against ONNX Runtime, one table per
pattern: latency medians, ratio, outputs checked, compile time.

    python scripts/bench_patterns.py [NAME ...] [--repeat N]
"""

import argparse
import os
import sys

os.environ.setdefault("TVM_NUM_THREADS", "2")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import souffle_py  # noqa: E402
from models.patterns import PATTERNS  # noqa: E402
from souffle_py.benchmark import measure  # noqa: E402


def main(argv) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("names", nargs="*", default=list(PATTERNS))
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args(argv)
    print("| pattern | ONNX Runtime (ms) | souffle-py (ms) | ratio | matches | compile (s) |")
    print("|---|---:|---:|---:|:---:|---:|")
    ok = True
    for name in args.names:
        proto, _ = PATTERNS[name]()
        rows = measure(proto, {"souffle-py": lambda p: souffle_py.optimize(p, quiet=True)}, repeat=args.repeat,
                       log=lambda s: None)
        ort, ours = rows[0], rows[1]
        ok &= bool(ours.matches)
        print(f"| {name} | {ort.median_ms:.3f} | {ours.median_ms:.3f} | {ours.median_ms / ort.median_ms:.2f}x | "
              f"{'yes' if ours.matches else 'NO'} | {ours.compile_s:.1f} |", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
