"""The corpus quantized by ONNX Runtime's tools, compiled by souffle-py and checked against ONNX Runtime
running the same int8 file (issue 53's first target).

    python scripts/int8_corpus.py --corpus DIR [--only SUBSTRING ...] [--exporters classic] [--json FILE]

Per export (scripts/corpus.py), in a process of its own (a crash or a timeout is one failed row): quantize
it as a user would - the transformers (hf_*) with `quantize_dynamic` (int8 weights), every other model with
`quantize_static` to QDQ, int8 activations and per-channel int8 weights, calibrated on four random batches
(tests/int8_models.py) - then compile it with souffle-py (strict: a rule that fails is an error) and compare
every output with ONNX Runtime's on the same file and inputs. Reported per output: the largest difference in
units of the output's quantization step where the output is a DequantizeLinear's (QDQ models), the share of
values that differ, and max |souffle - ORT| / max |ORT|, beside ONNX Runtime against itself with its graph
fusions off (how far its own float rounding moves the int8 values) and the quantization's own error (ONNX
Runtime int8, and souffle-py int8, against ONNX Runtime float32 on the original export). A float result one
bit off (GELU, LayerNorm, an fp32 sum in another order) flips a value lying at a half step of the next
DynamicQuantizeLinear by one step, and later layers move by more than a step (a random-weight network
amplifies it); the columns say how far. An export matches where max |souffle - ORT| / max |ORT| <= 1e-3,
or its outputs are within one step, or the difference is at most twice ONNX Runtime's own (fused against
unfused).
--json writes the rows; an existing file is resumed (exports already in it are skipped). --int8 saturating
compiles with optimize(int8="saturating") (on x86 without VNNI the arithmetic of ONNX Runtime's own AVX2
kernels, which this script compares against).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
os.environ.setdefault("TVM_NUM_THREADS", "2")

SCALE_TOLERANCE = 1e-3  # max |souffle - ORT| / max |ORT|, the float corpus's criterion (bench_corpus.py)
STEP_SLACK = 1e-3  # a step measured in float64 from float32 values: 1.0000024 is one step
ORT_SPREAD = 2.0  # or within twice ONNX Runtime's own difference, fused against unfused, on the same file
TIMEOUT_S = 1800


def output_steps(model) -> dict[str, float]:
    """Each graph output produced by a DequantizeLinear with a constant scalar scale: its step."""
    from onnx import numpy_helper
    constants = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute:
            constants[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
    producers = {out: node for node in model.graph.node for out in node.output}
    steps = {}
    for output in model.graph.output:
        node = producers.get(output.name)
        if node is not None and node.op_type == "DequantizeLinear" and node.input[1] in constants:
            scale = constants[node.input[1]]
            if scale.size == 1:
                steps[output.name] = float(scale.reshape(()))
    return steps


def check_export(path: str, fast_math: bool = True, arithmetic: str = "exact") -> dict:
    """Quantize, compile, compare (runs in the child process)."""
    import numpy as np
    import onnx

    import souffle_py
    from int8_models import quantized, random_feeds
    from souffle_py.baselines import OnnxRuntimeModel

    name = os.path.basename(path).split(".")[0]
    mode = "dynamic" if name.startswith("hf_") else "static"
    folder = tempfile.mkdtemp(prefix="int8_corpus_")
    fp32 = onnx.load(path)
    fp32.graph.name = name
    start = time.perf_counter()
    qpath = quantized(fp32, folder, mode=mode, per_channel=mode == "static")
    row = {"mode": mode if mode == "dynamic" else "static QDQ per-channel", "quantize_s": time.perf_counter() - start}
    int8 = onnx.load(qpath)
    row["quant_nodes"] = sum(node.op_type in ("QuantizeLinear", "DynamicQuantizeLinear", "MatMulInteger",
                                              "ConvInteger", "QLinearConv", "QLinearMatMul") for node in int8.graph.node)
    start = time.perf_counter()
    model = souffle_py.optimize(qpath, quiet=True, cache=False, fast_math=fast_math, int8=arithmetic)
    row["compile_s"], row["kernels"] = time.perf_counter() - start, model.num_kernels
    feeds = random_feeds(int8, 0)
    expected = OnnxRuntimeModel(qpath).run(feeds)
    got = model.run(feeds)
    steps = output_steps(int8)
    row["outputs"] = {}
    for key, ref in expected.items():
        ref, val = np.asarray(ref, np.float64), np.asarray(got[key], np.float64)
        diff = np.abs(val - ref)
        scale = float(np.max(np.abs(ref))) or 1.0
        entry = {"error_vs_scale": float(np.max(diff)) / scale, "differ_share": float(np.mean(diff > 0)),
                 "values": int(ref.size)}
        if key in steps:
            entry["max_steps"] = float(np.max(diff)) / steps[key]
        row["outputs"][key] = entry
    # the quantization's own error (ONNX Runtime int8 against ONNX Runtime float32), beside each difference
    reference = OnnxRuntimeModel(path).run(feeds)
    for key, entry in row["outputs"].items():
        ref = np.asarray(reference[key], np.float64)
        scale = float(np.max(np.abs(ref))) or 1.0
        entry["quantization_error_vs_scale"] = float(np.max(np.abs(np.asarray(expected[key], np.float64) - ref))) / scale
        entry["souffle_quantization_error_vs_scale"] = float(np.max(np.abs(np.asarray(got[key], np.float64) - ref))) / scale
    for name in ("quantization_error_vs_scale", "souffle_quantization_error_vs_scale"):
        row[name] = max(o[name] for o in row["outputs"].values())
    # ONNX Runtime against itself, its graph fusions off (e.g. MatMulIntegerToFloat, QLinearAdd unfused): how
    # far its own float rounding moves the int8 values (a last-bit change flips a value at a half step)
    plain = OnnxRuntimeModel(qpath, optimize=False).run(feeds)
    row["ort_unfused_vs_scale"] = max(float(np.max(np.abs(np.asarray(plain[k], np.float64) -
                                                          np.asarray(v, np.float64)))) /
                                      (float(np.max(np.abs(np.asarray(v, np.float64)))) or 1.0)
                                      for k, v in expected.items())
    errors = [o["error_vs_scale"] for o in row["outputs"].values()]
    row["error_vs_scale"] = max(errors)
    row["max_steps"] = max((o.get("max_steps", math.nan) for o in row["outputs"].values()), default=math.nan)
    shutil.rmtree(folder, ignore_errors=True)  # two copies of the model (float32 and int8)
    row["matches"] = (row["error_vs_scale"] <= SCALE_TOLERANCE or row["max_steps"] <= 1.0 + STEP_SLACK
                      or row["error_vs_scale"] <= ORT_SPREAD * row["ort_unfused_vs_scale"])
    return row


def run_child(path: str, fast_math: bool = True, arithmetic: str = "exact") -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as out:
        target = out.name
    command = [sys.executable, os.path.abspath(__file__), "--child", path, "--child-out", target] + \
        ([] if fast_math else ["--exact-math"]) + ["--int8", arithmetic]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timeout after {TIMEOUT_S} s"}
    if proc.returncode != 0 or not os.path.getsize(target):
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"ok": False, "error": f"exit {proc.returncode}: " + " | ".join(tail)[:800]}
    with open(target) as f:
        return {"ok": True, **json.load(f)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", required=False, default=os.path.join(os.environ.get("SOUFFLE_CACHE", ".souffle_cache"),
                                                                          "corpus"))
    parser.add_argument("--only", nargs="+", help="exports whose name contains one of these")
    parser.add_argument("--exporters", nargs="+", default=["classic"])
    parser.add_argument("--json", help="write (and resume) the rows here")
    parser.add_argument("--exact-math", action="store_true",
                        help="compile with fast_math=False (exact exp/erf/tanh): separates the int8 rounding from the "
                             "float approximations, whose last-bit differences can flip a value at a half step")
    parser.add_argument("--int8", default="exact", choices=("exact", "saturating"),
                        help="optimize()'s int8 arithmetic (saturating: vpmaddubsw on x86 without VNNI)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        row = check_export(args.child, fast_math=not args.exact_math, arithmetic=args.int8)
        with open(args.child_out, "w") as f:
            json.dump(row, f)
        return 0
    paths = sorted(os.path.join(args.corpus, f) for f in os.listdir(args.corpus)
                   if f.endswith(".onnx") and f.split(".")[1] in args.exporters
                   and (not args.only or any(s in f for s in args.only)))
    rows = {}
    if args.json and os.path.exists(args.json):
        with open(args.json) as f:
            rows = json.load(f)
    for path in paths:
        stem = os.path.basename(path)[:-5]
        if stem in rows:
            continue
        start = time.perf_counter()
        rows[stem] = {**run_child(path, not args.exact_math, args.int8), "wall_s": round(time.perf_counter() - start, 1)}
        row = rows[stem]
        if row["ok"]:
            print(f"{stem:40s} {row['mode']:24s} {'match' if row['matches'] else 'DIFFER':6s} "
                  f"error/scale {row['error_vs_scale']:.1e}  max steps {row['max_steps']:.1f}  "
                  f"(ORT unfused {row['ort_unfused_vs_scale']:.1e}; vs fp32: ORT int8 "
                  f"{row['quantization_error_vs_scale']:.1e}, souffle int8 "
                  f"{row['souffle_quantization_error_vs_scale']:.1e})  kernels {row['kernels']}  "
                  f"compile {row['compile_s']:.0f}s", flush=True)
        else:
            print(f"{stem:40s} FAILED {row['error']}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    ok = [r for r in rows.values() if r["ok"]]
    print(f"\n{len(ok)} of {len(rows)} compile; {sum(r['matches'] for r in ok)} match ONNX Runtime")
    return 0 if len(ok) == len(rows) and all(r["matches"] for r in ok) else 1


if __name__ == "__main__":
    sys.exit(main())
