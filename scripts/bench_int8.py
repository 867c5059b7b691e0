"""int8 models against ONNX Runtime running the same quantized file (issue 53's benchmark).

    python scripts/bench_int8.py                      # BERT-base (quantize_dynamic), ResNet-50 (QDQ, per channel)
    python scripts/bench_int8.py --tiny --repeat 3    # the tiny configurations: checks that the script works

Each model is built in float32 (models/), quantized by onnxruntime.quantization (BERT: quantize_dynamic;
ResNet-50: ResNeXt's builder with one group of 64 channels per stage and batch norms folded, quantize_static
to QDQ with per-channel weights and a random calibration reader), then timed by souffle_py.benchmark.measure:
the systems take turns in blocks, medians, ratios to ONNX Runtime, each system's max abs difference from
ONNX Runtime's outputs on the same file. souffle-py float32 on the float32 model is timed beside ONNX Runtime
float32 in a second table, with the int8 error against float32 ONNX Runtime printed below.
"""

from __future__ import annotations

import argparse
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
from souffle_py.baselines import OnnxRuntimeModel  # noqa: E402
from souffle_py.benchmark import format_table, measure  # noqa: E402

from int8_models import quantized, random_feeds  # noqa: E402

RESNET50 = dict(depths=(3, 4, 6, 3), cardinality=1, base_width=64, fold_bn=True)


def _models(tiny: bool):
    """(name, float32 model, quantization mode)."""
    bert = build_model("bert", tiny=True) if tiny else build_model("bert")
    resnet = build_model("resnext", tiny=True, fold_bn=True) if tiny else build_model("resnext", **RESNET50)
    resnet.graph.name = "resnet"
    return [("BERT-base int8 (dynamic)" if not tiny else "tiny BERT int8 (dynamic)", bert, "dynamic"),
            ("ResNet-50 int8 (QDQ, per channel)" if not tiny else "tiny ResNeXt int8 (QDQ)", resnet, "static")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny configurations (seconds)")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None, help="threads for every system (default: the cores)")
    args = parser.parse_args(argv)
    folder = tempfile.mkdtemp(prefix="bench_int8_")
    for title, fp32, mode in _models(args.tiny):
        path = quantized(fp32, folder, mode=mode, per_channel=mode == "static")
        int8 = onnx.load(path)
        systems = {"souffle-py int8": lambda proto: souffle_py.optimize(proto, quiet=True)}
        # int8 values agree with ONNX Runtime's to one step (tests/test_int8.py): matches within 2% of |y|
        scale = float(np.max(np.abs(OnnxRuntimeModel(int8, threads=args.threads).run(
            random_feeds(int8, 0))[int8.graph.output[0].name])))
        rows = measure(int8, systems, repeat=args.repeat, threads=args.threads, rtol=0.0, atol=0.02 * scale)
        print(format_table(f"{title}: the same quantized file", rows))
        rows32 = measure(fp32, {"souffle-py fp32": lambda proto: souffle_py.optimize(proto, quiet=True)},
                         repeat=args.repeat, threads=args.threads)
        print(format_table(f"{title}: float32 model", rows32))
        feeds = random_feeds(fp32, 0)
        reference = OnnxRuntimeModel(fp32, threads=args.threads).run(feeds)
        ours = souffle_py.optimize(int8, quiet=True).run(feeds)
        ort8 = OnnxRuntimeModel(int8, threads=args.threads).run(feeds)
        name = fp32.graph.output[0].name
        print(f"max abs error against float32 ONNX Runtime: souffle-py int8 "
              f"{np.max(np.abs(ours[name] - reference[name])):.4g}, ONNX Runtime int8 "
              f"{np.max(np.abs(ort8[name] - reference[name])):.4g} (largest |y| {np.max(np.abs(reference[name])):.4g})")
        fastest = {row.system: row.median_ms for row in rows + rows32}
        if "souffle-py fp32" in fastest and "souffle-py int8" in fastest:
            print(f"souffle-py int8 / fp32 speed-up: {fastest['souffle-py fp32'] / fastest['souffle-py int8']:.2f}x\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
