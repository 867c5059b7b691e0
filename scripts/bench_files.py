"""ONNX files compiled with souffle-py against ONNX Runtime, one row each: latency medians (interleaved
runs, souffle_py.benchmark.measure), ratio, outputs checked, compile time with an empty tuning database.

    python scripts/bench_files.py FILE.onnx [...] [--repeat N]
"""

import argparse
import os
import sys
import tempfile

os.environ.setdefault("TVM_NUM_THREADS", "2")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import onnx  # noqa: E402

import souffle_py  # noqa: E402
from souffle_py.benchmark import measure  # noqa: E402


def main(argv) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("files", nargs="+")
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args(argv)
    print("| model | ONNX Runtime (ms) | souffle-py (ms) | ratio | matches | compile (s) |")
    print("|---|---:|---:|---:|:---:|---:|")
    ok = True
    for path in args.files:
        proto = onnx.load(path)
        database = tempfile.mkdtemp(prefix="souffle-empty-")  # compile time with nothing cached
        rows = measure(proto, {"souffle-py": lambda p: souffle_py.optimize(p, quiet=True, database=database)},
                       repeat=args.repeat, log=lambda s: None)
        ort, ours = rows[0], rows[1]
        if ours.error:
            print(f"| {os.path.basename(path)} | {ort.median_ms:.3f} | failed: {ours.error} | | | |", flush=True)
            ok = False
            continue
        ok &= bool(ours.matches)
        print(f"| {os.path.basename(path)} | {ort.median_ms:.3f} | {ours.median_ms:.3f} | "
              f"{ours.median_ms / ort.median_ms:.2f}x | {'yes' if ours.matches else 'NO'} | {ours.compile_s:.1f} |",
              flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
