"""Where an int8 model's souffle-py result first leaves ONNX Runtime's: every quantized tensor compared.

    python scripts/int8_divergence.py MODEL_INT8.onnx [--first 6] [--seed 0]

An int8 model's outputs can differ from ONNX Runtime's by many steps although each layer differs by at most
one: a float value one bit apart (a GELU, a softmax, a float32 sum in another order) that lies at a half
step flips the next quantizer by one step, and later layers amplify it (scripts/int8_corpus.py reports the
outputs). This script says where it starts. It makes every QuantizeLinear and DynamicQuantizeLinear output
a graph output, compiles that model with souffle-py (strict) and runs it beside ONNX Runtime with its graph
optimizations on and off on the same random inputs (tests/int8_models.py), then lists, in graph order, the
first quantized tensors that differ: how many values, by how many steps, and which node computed the float
value the quantizer read; a DynamicQuantizeLinear scale (float) is listed where it differs in any bit. When
ONNX Runtime with and without its fusions agree on a tensor where souffle-py does not, look at what that
node computes in float32 on each side (ONNX Runtime may also run a QDQ convolution as a float32 Conv
between DequantizeLinear and QuantizeLinear: its optimized graph says which).

The extra outputs can change how either system fuses the graph; the compiled model's own outputs are
compared by scripts/int8_corpus.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
os.environ.setdefault("TVM_NUM_THREADS", "2")
os.environ.setdefault("SOUFFLE_STRICT", "1")

QUANTIZERS = ("QuantizeLinear", "DynamicQuantizeLinear")


def probe_model(model):
    """`model` with every quantizer's outputs (whose type shape inference knows) as graph outputs; their
    names in graph order."""
    from onnx import shape_inference

    model = shape_inference.infer_shapes(model)
    typed = {v.name: v for v in model.graph.value_info}
    present = {o.name for o in model.graph.output}
    names = [o for n in model.graph.node if n.op_type in QUANTIZERS for o in n.output if o]
    for name in names:
        if name not in present and name in typed:
            model.graph.output.append(typed[name])
    return model, [n for n in names if n in present or n in typed]


def compare(model, names, ours, plain, fused, first: int) -> list[str]:
    """One line per differing quantized tensor (at most `first` integer ones), in graph order."""
    import numpy as np

    producers = {out: node for node in model.graph.node for out in node.output}
    lines, shown = [], 0
    for name in names:
        if name not in plain or name not in ours:
            continue
        want, got, other = (np.asarray(x[name]) for x in (plain, ours, fused))
        if want.dtype.kind == "f":  # a dynamic quantization's scale: any bit counts
            if not np.array_equal(want, got):
                lines.append(f"{name}: scale {got.reshape(-1)[0]:.9e}, ONNX Runtime {want.reshape(-1)[0]:.9e}")
            continue
        steps = np.abs(got.astype(np.int64) - want)
        if not steps.any():
            continue
        quantizer = producers[name]
        source = producers.get(quantizer.input[0])
        made_by = f"{source.op_type} {source.name}" if source is not None else "a graph input"
        spread = np.abs(other.astype(np.int64) - want)
        lines.append(f"{name}: {int((steps > 0).sum())} of {steps.size} values differ, at most {int(steps.max())} "
                     f"step(s); its float input from {made_by}; ONNX Runtime fused vs unfused: "
                     f"{int((spread > 0).sum())} differ")
        shown += 1
        if shown >= first:
            break
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="an int8 ONNX model (QDQ, QOperator or dynamically quantized)")
    parser.add_argument("--first", type=int, default=6, help="integer tensors to list (default 6)")
    parser.add_argument("--seed", type=int, default=0, help="the random inputs' seed")
    args = parser.parse_args(argv)

    import onnx

    import souffle_py
    from int8_models import random_feeds
    from souffle_py.baselines import OnnxRuntimeModel

    model, names = probe_model(onnx.load(args.model))
    with tempfile.TemporaryDirectory(prefix="int8_divergence_") as folder:
        path = os.path.join(folder, "probe.onnx")
        onnx.save(model, path)
        feeds = random_feeds(model, args.seed)
        plain = OnnxRuntimeModel(path, optimize=False).run(feeds)
        fused = OnnxRuntimeModel(path).run(feeds)
        ours = souffle_py.optimize(path, quiet=True, cache=False).run(feeds)
    lines = compare(model, names, ours, plain, fused, args.first)
    print("\n".join(lines) if lines else "every quantized tensor equals ONNX Runtime's")
    print(f"({len(names)} quantized tensors compared against ONNX Runtime without its graph optimizations)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
