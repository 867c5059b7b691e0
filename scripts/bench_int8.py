"""int8 models against ONNX Runtime and OpenVINO running the same quantized file, and souffle-py float32 and
bfloat16 on the float32 model, in one interleaved run per model (issue 53's benchmark).

    python scripts/bench_int8.py [--repeat 20] [--threads N] [--only bert-dynamic bert-static resnet50]
    python scripts/bench_int8.py --tiny --repeat 3    # the tiny configurations: checks that the script works
    python scripts/bench_int8.py --reduce-range        # 7-bit weights: exact and vpmaddubsw on AVX2

Each model is built in float32 (models/) and quantized by onnxruntime.quantization: BERT-base with
quantize_dynamic (int8 weights, activations quantized at run time) and with quantize_static to QDQ
(per-channel weights, a random calibration reader); ResNet-50 (ResNeXt's builder with one group of 64
channels per stage, batch norms folded) with quantize_static to QDQ, per-channel weights. Per model, every
system takes turns in blocks on the same inputs (benchmark._interleaved_medians: a pause and warm-up runs
before each block), medians: souffle-py, ONNX Runtime and OpenVINO (float32 hint for its float parts) on the
int8 file (on a host with AVX2 and no VNNI also souffle-py with int8="saturating", the arithmetic of those
two runtimes' AVX2 kernels); souffle-py float32 and bfloat16 (where the host has AVX512_BF16) and ONNX Runtime float32 on the
float32 model. Printed per system: the median, its ratio to ONNX Runtime int8, its error against float32
ONNX Runtime (max |y - ref| / max |ref|), and for the int8 systems their difference from ONNX Runtime int8.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import souffle_py  # noqa: E402
from models.registry import build_model  # noqa: E402
from souffle_py.baselines import OnnxRuntimeModel, OpenVinoModel, openvino_available  # noqa: E402
from souffle_py.benchmark import _interleaved_medians  # noqa: E402
from souffle_py.cpu_target import CpuTarget  # noqa: E402
from souffle_py.errors import SouffleError  # noqa: E402
from souffle_py.host import num_threads  # noqa: E402
from souffle_py.schedule.int8_dot import dot4  # noqa: E402

from int8_models import quantized, random_feeds  # noqa: E402

RESNET50 = dict(depths=(3, 4, 6, 3), cardinality=1, base_width=64, fold_bn=True)
INT8_REFERENCE = "ONNX Runtime int8"
SATURATING = "souffle-py int8 sat."


def _models(tiny: bool) -> dict:
    """name -> (title, float32 model, quantization mode)."""
    bert = build_model("bert", tiny=True) if tiny else build_model("bert")
    resnet = build_model("resnext", tiny=True, fold_bn=True) if tiny else build_model("resnext", **RESNET50)
    resnet.graph.name = "resnet"
    size = "tiny " if tiny else ""
    return {"bert-dynamic": (f"{size}BERT{'' if tiny else '-base'} int8 (quantize_dynamic)", bert, "dynamic"),
            "bert-static": (f"{size}BERT{'' if tiny else '-base'} int8 (QDQ, per channel)", bert, "static"),
            "resnet50": ("tiny ResNeXt int8 (QDQ, per channel)" if tiny else "ResNet-50 int8 (QDQ, per channel)",
                         resnet, "static")}


def _error(outputs: dict, reference: dict) -> float:
    name = next(iter(reference))
    ref = np.asarray(reference[name], np.float64)
    return float(np.max(np.abs(np.asarray(outputs[name], np.float64) - ref)) / (np.max(np.abs(ref)) or 1.0))


def bench_model(title: str, fp32: onnx.ModelProto, mode: str, folder: str, repeat: int, threads: int,
                reduce_range: bool = False) -> dict:
    path = quantized(fp32, folder, mode=mode, per_channel=mode == "static", reduce_range=reduce_range)
    title += ", reduce_range (7-bit weights)" if reduce_range else ""
    int8 = onnx.load(path)
    feeds = random_feeds(fp32, 0)
    systems = {INT8_REFERENCE: OnnxRuntimeModel(path, threads=threads),
               "souffle-py int8": souffle_py.optimize(path, quiet=True)}
    if _host_saturates():  # the baselines' AVX2 arithmetic, opted into (optimize(int8="saturating"))
        systems[SATURATING] = souffle_py.optimize(path, int8="saturating", quiet=True)
    if openvino_available():
        systems["OpenVINO int8"] = OpenVinoModel(int8, threads, "f32")
    systems["ONNX Runtime fp32"] = OnnxRuntimeModel(fp32, threads=threads)
    systems["souffle-py fp32"] = souffle_py.optimize(fp32, quiet=True)
    try:
        systems["souffle-py bf16"] = souffle_py.optimize(fp32, precision="bf16", quiet=True)
    except SouffleError as exc:  # a host without AVX512_BF16: the column is left out, with the reason
        print(f"souffle-py bf16 left out: {exc}")
    outputs = {name: system.run(feeds) for name, system in systems.items()}
    reference = outputs["ONNX Runtime fp32"]
    medians = _interleaved_medians(systems, feeds, repeat=repeat, warmup=2, block=max(1, repeat // 4))
    rows = {}
    for name, ms in medians.items():
        row = {"median_ms": ms, "vs_ort_int8": ms / medians[INT8_REFERENCE],
               "error_vs_fp32": _error(outputs[name], reference)}
        if "int8" in name:
            row["difference_vs_ort_int8"] = _error(outputs[name], outputs[INT8_REFERENCE])
        rows[name] = row
    print(f"\n{title}; {threads} threads, {repeat} timed runs per system, interleaved")
    print(f"{'system':20s} {'median ms':>10s} {'/ ORT int8':>11s} {'err vs fp32':>12s} {'diff vs ORT int8':>17s}")
    for name, row in rows.items():
        diff = f"{row['difference_vs_ort_int8']:.1e}" if "difference_vs_ort_int8" in row else "-"
        print(f"{name:20s} {row['median_ms']:10.3f} {row['vs_ort_int8']:11.3f} {row['error_vs_fp32']:12.1e} "
              f"{diff:>17s}")
    speedup = medians["souffle-py fp32"] / medians["souffle-py int8"]
    print(f"souffle-py int8 / fp32 speed-up: {speedup:.2f}x")
    result = {"title": title, "threads": threads, "repeat": repeat, "systems": rows, "int8_speedup": speedup}
    if SATURATING in medians:
        result["saturating_speedup"] = medians["souffle-py fp32"] / medians[SATURATING]
        print(f"{SATURATING} / fp32 speed-up: {result['saturating_speedup']:.2f}x")
    return result


def _host_saturates() -> bool:
    """Whether the host has no VNNI but AVX2, where ONNX Runtime's and OpenVINO's int8 kernels saturate
    (vpmaddubsw) and souffle-py's exact default differs from them in arithmetic (schedule/int8_dot.py)."""
    dot = dot4(CpuTarget.host_cpu())
    return dot is not None and dot.split_weights


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny configurations (seconds)")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None, help="threads for every system (default: the cores)")
    parser.add_argument("--only", nargs="+", choices=["bert-dynamic", "bert-static", "resnet50"])
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--reduce-range", action="store_true",
                        help="quantize with reduce_range (7-bit weights, ONNX Runtime's advice for CPUs without VNNI): "
                             "no pair of products can saturate, and souffle-py's exact default takes vpmaddubsw")
    args = parser.parse_args(argv)
    folder = tempfile.mkdtemp(prefix="bench_int8_")
    results = []
    for key, (title, fp32, mode) in _models(args.tiny).items():
        if args.only and key not in args.only:
            continue
        results.append(bench_model(title, fp32, mode, folder, args.repeat, args.threads or num_threads(),
                                   args.reduce_range))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
