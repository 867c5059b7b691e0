"""Process replay: record the scheduled TIR of a set of models, and diff two records (souffle_py/replay.py).

    python scripts/replay.py record OUT [--tiny] [--paper NAME ...] [--corpus DIR [--only NAME ...]]
    python scripts/replay.py diff BEFORE AFTER [--lines 40] [--structure]

Record before a change (e.g. in a worktree of the commit before) and after it, then diff: every kernel whose
generated TIR changed is listed with its diff, so a refactor shows exactly what it changed, and a change
meant for one model shows which others it reaches. `--tiny` records the paper models' tiny configurations
(seconds each), `--paper` the paper configurations named, `--corpus DIR` the corpus's exports (one
process, compile time only: no timing). Models that fail to compile are recorded as failed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from models.registry import MODEL_NAMES, build_model  # noqa: E402
from souffle_py.replay import diff_records, format_diffs, record_model  # noqa: E402

PAPER = ("bert", "lstm", "resnext", "efficientnet", "swin", "mmoe")


def _record(args) -> int:
    out = Path(args.out)
    jobs = []
    if args.tiny:
        jobs += [(f"{name}-tiny", lambda n=name: build_model(n, tiny=True)) for name in PAPER]
    jobs += [(name, lambda n=name: build_model(n)) for name in args.paper or ()]
    if args.corpus:
        for path in sorted(Path(args.corpus).glob("*.onnx")):
            if not args.only or any(o in path.stem for o in args.only):
                jobs.append((path.stem, lambda p=path: str(p)))
    failed = 0
    for name, model in jobs:
        start = time.perf_counter()
        try:
            count = record_model(model(), out / name)
            print(f"{name}: {count} kernel functions in {time.perf_counter() - start:.1f} s", flush=True)
        except Exception:  # noqa: BLE001  (one failed model is a line of the record, not the end of it)
            failed += 1
            (out / name).mkdir(parents=True, exist_ok=True)
            (out / name / "describe.txt").write_text("FAILED\n" + traceback.format_exc())
            print(f"{name}: FAILED", flush=True)
    return 1 if failed else 0


def _diff(args) -> int:
    diffs = diff_records(args.before, args.after, structure_only=args.structure)
    print(format_diffs(diffs, args.lines))
    return 1 if diffs else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    record = sub.add_parser("record", help="compile the models and write their scheduled TIR")
    record.add_argument("out")
    record.add_argument("--tiny", action="store_true", help="the paper models' tiny configurations")
    record.add_argument("--paper", nargs="*", choices=sorted(MODEL_NAMES), help="paper configurations to record")
    record.add_argument("--corpus", help="a folder of exports (scripts/corpus.py)")
    record.add_argument("--only", nargs="*", help="with --corpus: only exports whose name contains one of these")
    diff = sub.add_parser("diff", help="what changed between two records (exit 1 when anything did)")
    diff.add_argument("before")
    diff.add_argument("after")
    diff.add_argument("--lines", type=int, default=40, help="diff lines shown per kernel")
    diff.add_argument("--structure", action="store_true",
                      help="compare the loop and block skeletons only (a change of values, not of schedules)")
    args = parser.parse_args()
    return _record(args) if args.command == "record" else _diff(args)


if __name__ == "__main__":
    sys.exit(main())
