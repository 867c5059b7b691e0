"""Tiny float32 models and their int8 versions made by onnxruntime.quantization (tests/test_int8.py,
scripts/bench_int8.py): a conv net (3 convs with ReLU, a residual add), an MLP (MatMul + Add + Relu),
ConvNeXt's pointwise block, and the tiny BERT of models/; quantized with `quantize_static` (a random
calibration reader, QDQ or QOperator, s8s8 or u8s8, per-tensor or per-channel weights) or `quantize_dynamic`."""

from __future__ import annotations

import os
import tempfile

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 8  # onnxruntime 1.31 reads IR versions up to 13; onnx 1.23 writes 14 by default


def _weight(rng, name, shape, scale):
    return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)


def conv_net(seed: int = 0, channels: int = 16, size: int = 16) -> onnx.ModelProto:
    """conv3x3 -> relu -> conv3x3/2 -> relu -> conv1x1, plus the strided conv's output added back (a
    residual add: QLinearAdd in QOperator form)."""
    rng = np.random.default_rng(seed)
    inits = [_weight(rng, "W1", (8, 3, 3, 3), 0.3), _weight(rng, "B1", (8,), 0.1),
             _weight(rng, "W2", (channels, 8, 3, 3), 0.2), _weight(rng, "B2", (channels,), 0.1),
             _weight(rng, "W3", (channels, channels, 1, 1), 0.2)]
    nodes = [helper.make_node("Conv", ["x", "W1", "B1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "W2", "B2"], ["c2"], pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Relu", ["c2"], ["r2"]),
             helper.make_node("Conv", ["r2", "W3"], ["c3"]),
             helper.make_node("Add", ["c3", "r2"], ["y"])]
    half = size // 2
    graph = helper.make_graph(nodes, "conv_net",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, size, size])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, channels, half, half])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION)


def mlp(seed: int = 0, rows: int = 8, dims=(64, 128, 32), relu_input: bool = False) -> onnx.ModelProto:
    """(MatMul + Add + Relu) x 2, then a MatMul; `relu_input`: a Relu first (every GEMM then reads ReLU
    outputs, whose quantization's zero point is 0)."""
    rng = np.random.default_rng(seed)
    nodes, inits, current = [], [], "x"
    if relu_input:
        nodes, current = [helper.make_node("Relu", ["x"], ["x_relu"])], "x_relu"
    for layer, (k, n) in enumerate(zip(dims[:-1], dims[1:])):
        inits += [_weight(rng, f"W{layer}", (k, n), 1 / np.sqrt(k)), _weight(rng, f"B{layer}", (n,), 0.1)]
        nodes += [helper.make_node("MatMul", [current, f"W{layer}"], [f"m{layer}"]),
                  helper.make_node("Add", [f"m{layer}", f"B{layer}"], [f"a{layer}"]),
                  helper.make_node("Relu", [f"a{layer}"], [f"h{layer}"])]
        current = f"h{layer}"
    inits.append(_weight(rng, "Wout", (dims[-1], 16), 1 / np.sqrt(dims[-1])))
    nodes.append(helper.make_node("MatMul", [current, "Wout"], ["y"]))
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, dims[0]])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, 16])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION)


def pointwise_block(seed: int = 0, channels: int = 32, size: int = 14) -> onnx.ModelProto:
    """ConvNeXt's pointwise MLP on a channels-last map: MatMul + Add, GELU (the Erf form torch exports),
    MatMul + Add, the input added back; size x size rows (196: no register tile divides them)."""
    rng = np.random.default_rng(seed)
    c = channels
    inits = [_weight(rng, "W1", (c, 4 * c), 1 / np.sqrt(c)), _weight(rng, "B1", (4 * c,), 0.1),
             _weight(rng, "W2", (4 * c, c), 1 / np.sqrt(4 * c)), _weight(rng, "B2", (c,), 0.1)]
    inits += [numpy_helper.from_array(np.array(v, np.float32), n)
              for n, v in (("inv_sqrt2", 0.7071067811865476), ("one", 1.0), ("half", 0.5))]
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["m1"]), helper.make_node("Add", ["m1", "B1"], ["a1"]),
             helper.make_node("Mul", ["a1", "inv_sqrt2"], ["g0"]), helper.make_node("Erf", ["g0"], ["g1"]),
             helper.make_node("Add", ["g1", "one"], ["g2"]), helper.make_node("Mul", ["a1", "g2"], ["g3"]),
             helper.make_node("Mul", ["g3", "half"], ["h"]),
             helper.make_node("MatMul", ["h", "W2"], ["m2"]), helper.make_node("Add", ["m2", "B2"], ["a2"]),
             helper.make_node("Add", ["a2", "x"], ["y"])]
    shape = [1, size, size, c]
    graph = helper.make_graph(nodes, "pointwise_block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION)


def random_feeds(model: onnx.ModelProto, seed: int) -> dict[str, np.ndarray]:
    """Feeds for every graph input: standard normal floats, token ids within 16 (the tiny BERT's vocabulary
    is larger), ones for masks."""
    rng = np.random.default_rng(seed)
    weights = {init.name for init in model.graph.initializer}
    feeds = {}
    for vi in model.graph.input:
        if vi.name in weights:
            continue
        tt = vi.type.tensor_type
        shape = [d.dim_value for d in tt.shape.dim]
        dtype = helper.tensor_dtype_to_np_dtype(tt.elem_type)
        if np.issubdtype(dtype, np.floating):
            feeds[vi.name] = rng.standard_normal(shape).astype(dtype)
        elif "mask" in vi.name:
            feeds[vi.name] = np.ones(shape, dtype)
        else:
            feeds[vi.name] = rng.integers(0, 16, shape).astype(dtype)
    return feeds


class _Reader:
    """A CalibrationDataReader of a few random batches."""

    def __init__(self, model, batches: int = 4, seed: int = 100):
        self._feeds = iter([random_feeds(model, seed + i) for i in range(batches)])

    def get_next(self):
        return next(self._feeds, None)

    def rewind(self):  # noqa: D401  (the quantizer may ask; one pass is enough for MinMax)
        pass


def quantized(model: onnx.ModelProto, folder: str, mode: str = "static", fmt: str = "QDQ",
              activations: str = "int8", weights: str = "int8", per_channel: bool = False,
              reduce_range: bool = False) -> str:
    """The path of `model` quantized by onnxruntime.quantization (mode "static" or "dynamic"; `reduce_range`:
    7-bit weights, ONNX Runtime's advice for CPUs without VNNI)."""
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic, quantize_static
    types = {"int8": QuantType.QInt8, "uint8": QuantType.QUInt8}
    src = os.path.join(folder, f"{model.graph.name}_fp32.onnx")
    onnx.save(model, src)
    dst = os.path.join(folder, f"{model.graph.name}_{mode}_{fmt}_{activations}_{weights}_{int(per_channel)}"
                               f"{'_rr' if reduce_range else ''}.onnx")
    if mode == "dynamic":
        quantize_dynamic(src, dst, weight_type=types[weights], per_channel=per_channel, reduce_range=reduce_range)
    else:
        quantize_static(src, dst, _Reader(model), quant_format=getattr(QuantFormat, fmt), per_channel=per_channel,
                        activation_type=types[activations], weight_type=types[weights], reduce_range=reduce_range)
    return dst


def scratch_dir() -> str:
    return tempfile.mkdtemp(prefix="souffle_int8_")
