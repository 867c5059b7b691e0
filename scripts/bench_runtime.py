"""What a service sees of the runtime: the fixed cost of one run() call, and throughput with 1, 2 and 4
caller threads sharing one compiled model, side by side with ONNX Runtime (one session shared the same way).

    python scripts/bench_runtime.py [--calls 2000] [--seconds 3] [--layers 2] [--rounds 3]

Call cost: run() of a one-node Add over 16 floats, median of `--calls` calls, the two systems alternated
in `--rounds` rounds (ONNX Runtime's `InferenceSession.run` called directly). Throughput: a BERT encoder
(`--layers` layers of BERT-base width, 128 tokens) run by
N Python threads for `--seconds` each round, inferences per second; each system on TVM_NUM_THREADS=1 /
intra_op_num_threads=1, so that N callers use N cores (the way a server with one worker thread per core
runs). Run it alone on the machine: it measures cores.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time

os.environ["TVM_NUM_THREADS"] = "1"  # before TVM starts: each caller thread's pool is that one thread

import numpy as np  # noqa: E402
import onnx  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import souffle_py  # noqa: E402
from models.common import IR_VERSION  # noqa: E402
from models.registry import build_model  # noqa: E402
from souffle_py.baselines import OnnxRuntimeModel  # noqa: E402


def add_model() -> onnx.ModelProto:
    values = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [16]) for n in "xyz"]
    graph = helper.make_graph([helper.make_node("Add", ["x", "y"], ["z"])], "add", values[:2], values[2:])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=IR_VERSION)


def call_cost_us(run, feeds, calls: int) -> float:
    for _ in range(calls // 10):
        run(feeds)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        run(feeds)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def throughput(run, feeds_list, threads: int, seconds: float) -> float:
    """Inferences per second of `threads` callers, each running for `seconds` after a common start."""
    counts = [0] * threads
    barrier = threading.Barrier(threads + 1)
    stop = [0.0]

    def work(t):
        feeds = feeds_list[t % len(feeds_list)]
        run(feeds)
        barrier.wait()
        n = 0
        while time.perf_counter() < stop[0]:
            run(feeds)
            n += 1
        counts[t] = n

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    stop[0] = time.perf_counter() + 1e9
    barrier.wait()
    start = time.perf_counter()
    stop[0] = start + seconds
    for w in workers:
        w.join()
    return sum(counts) / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as folder:
        add = add_model()
        ours, ort = souffle_py.optimize(add, quiet=True), OnnxRuntimeModel(add, threads=1)
        feeds = {"x": np.ones(16, np.float32), "y": np.ones(16, np.float32)}
        costs = {"souffle-py": [], "ONNX Runtime": []}
        for _ in range(args.rounds):
            costs["souffle-py"].append(call_cost_us(ours.run, feeds, args.calls))
            costs["ONNX Runtime"].append(call_cost_us(lambda f: ort.session.run(None, f), feeds, args.calls))
        print(f"## Call cost: one-node Add over 16 floats (median of {args.calls} calls, {args.rounds} rounds)\n")
        print("| system | per call (us), each round | median |\n|---|---|---:|")
        for name, values in costs.items():
            print(f"| {name} | {', '.join(f'{v:.2f}' for v in values)} | {statistics.median(values):.2f} |")

        path = os.path.join(folder, "bert.onnx")
        onnx.save(build_model("bert", layers=args.layers), path)
        ours, ort = souffle_py.optimize(path, quiet=True), OnnxRuntimeModel(path, threads=1)
        feeds_list = [ours.random_feeds(seed=s) for s in range(max(args.threads))]
        rates = {(name, n): [] for name in ("souffle-py", "ONNX Runtime") for n in args.threads}
        for _ in range(args.rounds):
            for n in args.threads:
                rates["souffle-py", n].append(throughput(ours.run, feeds_list, n, args.seconds))
                rates["ONNX Runtime", n].append(throughput(lambda f: ort.session.run(None, f), feeds_list, n,
                                                           args.seconds))
        print(f"\n## Throughput: BERT encoder, {args.layers} layers of BERT-base width, 128 tokens; N caller "
              f"threads on one model, one intra-op thread each ({args.rounds} rounds of {args.seconds:.0f} s, "
              f"medians; {os.cpu_count()} cores)\n")
        print("| callers | souffle-py (inf/s) | x one caller | ONNX Runtime (inf/s) | x one caller "
              "| souffle-py / ORT |")
        print("|---:|---:|---:|---:|---:|---:|")
        base = {name: statistics.median(rates[name, args.threads[0]]) for name in ("souffle-py", "ONNX Runtime")}
        for n in args.threads:
            s, o = statistics.median(rates["souffle-py", n]), statistics.median(rates["ONNX Runtime", n])
            print(f"| {n} | {s:.1f} | {s / base['souffle-py']:.2f} | {o:.1f} | {o / base['ONNX Runtime']:.2f} "
                  f"| {s / o:.2f} |")
        print(f"\nsouffle-py workspaces made: {ours._pool.created} of {ours.workspace_bytes / 2**20:.1f} MiB each")
    return 0


if __name__ == "__main__":
    sys.exit(main())
