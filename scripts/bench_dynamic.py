"""Dynamic shapes: one souffle-py DynamicModel over sequence lengths and batch sizes, side by side with ONNX
Runtime and OpenVINO f32 (one session each, dynamic shapes) and souffle-py's static compile of each shape.

    python scripts/bench_dynamic.py [--tiny] [--model FILE.onnx] [--lengths 8,13,...] [--batches 1,2,8]
                                    [--repeat N] [--budget-s S] [--no-static] [--no-openvino] [--json FILE]
                                    [--cache] [--compile-only]

The model: BERT-base (models/, full size) with symbolic batch and sequence (models/dynamic.py), or --model,
an ONNX file whose inputs have the dim_params "batch" and "sequence" (e.g. a transformer exported with
dynamic axes); --tiny takes the tiny BERT (a quick check that the script runs).
Per shape (batch-major): the static compile (optimize(input_shapes=...) and its first call, where LLVM
emits the machine code; no compile cache), the DynamicModel's first call at the shape (its compile, the
same way, timed; no compile cache either), a check of every output against ONNX Runtime
(max |x - ORT| / max |ORT| <= 1e-3, NaN where ORT has NaN), then every system's run() (inputs to outputs,
as an application calls it; the DynamicModel's includes its shape dispatch) in interleaved rounds
(benchmark.py), medians. The static model is dropped after its shape (BERT-base's weights are 440 MB); the
DynamicModel keeps every shape, its weights shared.
With --cache both compiles go through the compile cache (their times are then loads, not compiles), so that
a run with --compile-only beforehand (compiles and stores every shape, no timing; it needs no quiet host)
leaves the timed run only the timing to do.
Printed: one row per shape, the geomean ratios (dynamic / static, dynamic / ONNX Runtime, dynamic /
OpenVINO), the DynamicModel's optimize() time (it compiles the smallest shape) against one static compile,
and its compile time per new shape.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("TVM_NUM_THREADS", "2")

LENGTHS = (8, 13, 31, 64, 97, 128, 131, 199, 256, 257, 383, 509, 512)  # 8 primes among them
BATCHES = (1, 2, 8)
SCALE_TOLERANCE = 1e-3
SOUFFLE_STATIC, SOUFFLE_DYNAMIC, ORT, OPENVINO = "souffle static", "souffle dynamic", "ONNX Runtime", "OpenVINO f32"


class RunTimer:
    """benchmark() over run(feeds): what an application sees, for every system alike."""

    def __init__(self, model):
        self.model = model

    def benchmark(self, feeds, repeat: int = 10, warmup: int = 2) -> dict:
        for _ in range(warmup):
            self.model.run(feeds)
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            self.model.run(feeds)
            times.append((time.perf_counter() - start) * 1e3)
        return {"median_ms": statistics.median(times), "times_ms": times}


def scaled_error(ours: dict, expected: dict) -> float:
    import numpy as np

    worst = 0.0
    for name, value in expected.items():
        got = ours[name]
        nan = np.isnan(value)
        if not np.array_equal(nan, np.isnan(got)):
            return math.inf
        scale = float(np.max(np.abs(value[~nan]))) if (~nan).any() else 1.0
        worst = max(worst, float(np.max(np.abs(got[~nan] - value[~nan]), initial=0.0)) / (scale or 1.0))
    return worst


def geomean(values) -> float:
    values = [v for v in values if v and v > 0 and math.isfinite(v)]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else math.nan


def compile_only(proto, model, batches, lengths, static: bool) -> int:
    """Compile every shape, dynamic and static, into the compile cache; no timing."""
    import souffle_py

    model.max_shapes = 1  # each shape goes to the cache; a process holding every BERT-base shape ran out of memory
    for batch in batches:
        for length in lengths:
            shape = {"batch": batch, "sequence": length}
            start = time.perf_counter()
            model.run(model.random_feeds(0, shape))
            if static:  # the same compile as the DynamicModel's shape: a hit unless its key differs
                souffle_py.optimize(proto, input_shapes=model.spec.shapes(model.spec.check_key(shape)),
                                    cache=True, quiet=True)
            print(f"batch {batch} sequence {length}: {time.perf_counter() - start:.1f}s", flush=True)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny BERT (checks that the script runs)")
    parser.add_argument("--model", help="an ONNX file with dim_params 'batch' and 'sequence' (default: BERT-base)")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--repeat", type=int, default=20, help="timed runs per system and shape (at most)")
    parser.add_argument("--budget-s", type=float, default=4.0,
                        help="timed seconds per system and shape: fewer runs for large shapes (at least 3)")
    parser.add_argument("--no-static", action="store_true", help="skip the static compile per shape")
    parser.add_argument("--no-openvino", action="store_true")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    parser.add_argument("--cache", action="store_true",
                        help="compile through the compile cache (compile times become load times)")
    parser.add_argument("--max-shapes", type=int, default=None,
                        help="shapes the DynamicModel keeps (least recently used dropped; default: all)")
    parser.add_argument("--compile-only", action="store_true",
                        help="compile every shape into the compile cache and stop (implies --cache; no timing)")
    args = parser.parse_args(argv)
    args.cache = args.cache or args.compile_only

    import onnx

    import souffle_py
    from models.dynamic import symbolic
    from souffle_py.baselines import OnnxRuntimeModel, OpenVinoModel, openvino_available
    from souffle_py.benchmark import _interleaved_medians

    lengths = [int(v) for v in args.lengths.split(",")]
    batches = [int(v) for v in args.batches.split(",")]
    proto = onnx.load(args.model) if args.model else symbolic("bert", tiny=args.tiny)
    name = args.model or ("tiny BERT" if args.tiny else "BERT-base") + " (models/, symbolic batch and sequence)"
    dynamic = {"batch": (min(batches), max(batches)), "sequence": (min(lengths), max(lengths))}
    threads = int(os.environ["TVM_NUM_THREADS"])
    print(f"{name}; batches {batches}, lengths {lengths}; {threads} threads", flush=True)

    start = time.perf_counter()
    model = souffle_py.optimize(proto, dynamic=dynamic, cache=args.cache, quiet=True)
    optimize_s = time.perf_counter() - start
    print(f"DynamicModel: optimize() {optimize_s:.1f}s (compiles the smallest shape"
          f"{'; compile cache on: compile times are load times where it holds the shape' if args.cache else ''})",
          flush=True)
    if args.max_shapes:
        model.max_shapes = args.max_shapes
    if args.compile_only:
        return compile_only(proto, model, batches, lengths, static=not args.no_static)
    systems = {ORT: RunTimer(OnnxRuntimeModel(proto, threads=threads))}
    if not args.no_openvino and openvino_available():
        systems[OPENVINO] = RunTimer(OpenVinoModel(proto, threads, "f32"))

    rows = []
    header = (f"{'batch':>5} {'seq':>5} {'ORT ms':>9} {'OV ms':>9} {'static ms':>10} {'dynamic ms':>11} "
              f"{'dyn/stat':>8} {'dyn/ORT':>8} {'dyn/OV':>7} {'error':>8} {'static s':>9} {'dyn s':>7}")
    print(header, flush=True)
    for batch in batches:
        for length in lengths:
            shape = {"batch": batch, "sequence": length}
            feeds = model.random_feeds(0, shape)
            row = {"batch": batch, "sequence": length}
            timed = dict(systems)
            if not args.no_static:
                start = time.perf_counter()
                static = souffle_py.optimize(proto, input_shapes=model.spec.shapes(model.spec.check_key(shape)),
                                             cache=args.cache, quiet=True)
                static.run(feeds)  # LLVM emits the machine code at the first call: part of the compile
                row["static_compile_s"] = time.perf_counter() - start
                timed[SOUFFLE_STATIC] = RunTimer(static)
            start = time.perf_counter()
            outputs = model.run(feeds)  # compiles the shape
            row["dynamic_first_call_s"] = time.perf_counter() - start
            timed[SOUFFLE_DYNAMIC] = RunTimer(model)
            expected = systems[ORT].model.run(feeds)
            row["error_vs_scale"] = scaled_error(outputs, expected)
            row["matches"] = row["error_vs_scale"] <= SCALE_TOLERANCE
            one_ms = min(RunTimer(m.model).benchmark(feeds, 1, 1)["median_ms"] for m in timed.values())
            repeat = max(3, min(args.repeat, int(args.budget_s * 1e3 / max(one_ms, 1e-3))))
            medians = _interleaved_medians(timed, feeds, repeat=repeat, warmup=2, block=max(1, repeat // 3))
            row.update({f"{k}_ms": v for k, v in medians.items()}, repeat=repeat)
            if not args.no_static:
                del timed[SOUFFLE_STATIC], static
            dyn = medians[SOUFFLE_DYNAMIC]
            ratio = lambda system: dyn / medians[system] if system in medians else math.nan  # noqa: E731
            row.update(dynamic_vs_static=ratio(SOUFFLE_STATIC), dynamic_vs_ort=ratio(ORT),
                       dynamic_vs_openvino=ratio(OPENVINO))
            rows.append(row)
            cell = lambda system: f"{medians[system]:.2f}" if system in medians else "-"  # noqa: E731
            print(f"{batch:>5} {length:>5} {cell(ORT):>9} {cell(OPENVINO):>9} {cell(SOUFFLE_STATIC):>10} "
                  f"{dyn:>11.2f} {row['dynamic_vs_static']:>8.3f} {row['dynamic_vs_ort']:>8.3f} "
                  f"{row['dynamic_vs_openvino']:>7.3f} {row['error_vs_scale']:>8.1e}"
                  f"{'' if row['matches'] else '!'} {row.get('static_compile_s', math.nan):>9.1f} "
                  f"{row['dynamic_first_call_s']:>7.1f}", flush=True)

    static_compiles = [r["static_compile_s"] for r in rows if "static_compile_s" in r]
    precompiled = model.specialised_shapes[:1]  # the shape optimize() compiled
    first_calls = [r["dynamic_first_call_s"] for r in rows
                   if {"batch": r["batch"], "sequence": r["sequence"]} not in precompiled]
    summary = {
        "model": name, "threads": threads, "shapes": len(rows), "all_match": all(r["matches"] for r in rows),
        "geomean_dynamic_vs_static": geomean(r["dynamic_vs_static"] for r in rows),
        "geomean_dynamic_vs_ort": geomean(r["dynamic_vs_ort"] for r in rows),
        "geomean_dynamic_vs_openvino": geomean(r["dynamic_vs_openvino"] for r in rows),
        "dynamic_optimize_s": optimize_s,
        "static_compile_median_s": statistics.median(static_compiles) if static_compiles else None,
        "dynamic_first_call_median_s": statistics.median(first_calls) if first_calls else math.nan,
        "dynamic_compile_total_s": optimize_s + sum(first_calls),
    }
    print(f"\nevery output matches ONNX Runtime: {summary['all_match']}")
    print(f"geomean latency: dynamic / static {summary['geomean_dynamic_vs_static']:.3f}, dynamic / ONNX Runtime "
          f"{summary['geomean_dynamic_vs_ort']:.3f}, dynamic / OpenVINO f32 "
          f"{summary['geomean_dynamic_vs_openvino']:.3f}")
    static_text = (f" vs one static compile {summary['static_compile_median_s']:.1f}s (median; ratio "
                   f"{optimize_s / summary['static_compile_median_s']:.2f}x)" if static_compiles else "")
    if args.cache:
        static_text = " (compile cache on: these are load times, not compiles)"
    print(f"dynamic compile: optimize() {optimize_s:.1f}s{static_text}; each new shape's first call "
          f"{summary['dynamic_first_call_median_s']:.1f}s (median, the shape optimize() compiled left out), "
          f"{summary['dynamic_compile_total_s']:.0f}s for "
          f"all {len(rows)} shapes")
    print(model.describe().splitlines()[1])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "rows": rows}, f, indent=1)
        print(f"wrote {args.json}")
    return 0 if summary["all_match"] else 1


if __name__ == "__main__":
    sys.exit(main())
