"""Wall time of a CPU tune measured on one or more local RPC servers (docs/tuning.md, issue 29).

    python scripts/bench_rpc_tuning.py --servers 2 --trials 64 [--model bert] [--threads 1]

Starts a TVM RPC tracker and `--servers` rpc_servers on 127.0.0.1 (TVM's own modules, each server with
`--threads` TVM threads), compiles the tiny configuration of the model with `trials` into a fresh database
with its candidates measured on those servers, and prints the tune's wall time and the candidates each
server measured. Every process it started is stopped by its id. Run it once per server count and compare.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--trials", type=int, default=64)
    parser.add_argument("--model", default="bert")
    parser.add_argument("--threads", type=int, default=1, help="TVM threads of each server")
    args = parser.parse_args()

    import souffle_py
    from models.registry import build_model
    from rpc_util import LocalPool

    proto = build_model(args.model, tiny=True)
    with tempfile.TemporaryDirectory(prefix="souffle-rpc-bench-") as folder:
        pool = LocalPool(Path(folder), servers=args.servers, threads=args.threads)
        try:
            runner = souffle_py.RpcTracker.parse(pool.address, pool.key)
            start = time.perf_counter()
            model = souffle_py.optimize(proto, trials=args.trials, database=Path(folder) / "db", runner=runner,
                                        quiet=True)
            seconds = time.perf_counter() - start
            measured = [pool.measured(server) for server in pool.servers]
        finally:
            pool.stop()
    print(f"{args.model} (tiny), {args.trials} trials, {args.servers} server(s) x {args.threads} thread(s): "
          f"compiled and tuned in {seconds:.1f} s (compile_seconds {model.compile_seconds:.1f}); candidates "
          f"measured per server {measured}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
