"""A small ONNX graph builder shared by the model builders: seeded weights, unique names, valid models.

onnx 1.23 writes IR version 14 by default, which onnxruntime 1.31 rejects; every model built here uses
IR_VERSION instead.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

IR_VERSION = 10
DEFAULT_OPSET = 17


class GraphBuilder:
    """Accumulates nodes, initializers and graph inputs/outputs; `node()` returns output names."""

    def __init__(self, name: str, seed: int = 0, opset: int = DEFAULT_OPSET):
        self.name = name
        self.opset = opset
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._counts: dict[str, int] = {}

    def unique(self, base: str) -> str:
        n = self._counts.get(base, 0)
        self._counts[base] = n + 1
        return base if n == 0 else f"{base}_{n}"

    def input(self, name: str, shape, dtype=TensorProto.FLOAT) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, dtype, list(shape)))
        return name

    def output(self, name: str, shape=None, dtype=TensorProto.FLOAT) -> str:
        self.outputs.append(helper.make_tensor_value_info(name, dtype, None if shape is None else list(shape)))
        return name

    def const(self, name: str, value) -> str:
        """An initializer holding `value` exactly (a numpy array or something np.asarray accepts)."""
        name = self.unique(name)
        self.initializers.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def weight(self, name: str, shape, scale: float | None = None) -> str:
        """A float32 initializer with seeded normal values; default scale 1/sqrt(fan_in) keeps activations tame."""
        if scale is None:
            fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else int(shape[0])
            scale = 1.0 / np.sqrt(max(fan_in, 1))
        value = (self.rng.standard_normal(shape) * scale).astype(np.float32)
        return self.const(name, value)

    def node(self, op_type: str, inputs, name: str | None = None, outputs: int = 1, **attrs):
        """Add one node; returns its output name (or a list of names when outputs > 1)."""
        name = self.unique(name or op_type)
        outs = [name if outputs == 1 else f"{name}_out{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=name, **attrs))
        return outs[0] if outputs == 1 else outs

    def model(self) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, self.initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset)],
                                  producer_name="souffle-py models", ir_version=IR_VERSION)
        onnx.checker.check_model(model)
        return model


BN_EPS = 1e-5


def conv_bn(b: GraphBuilder, x: str, name: str, cin: int, cout: int, kernel: int, stride: int = 1,
            groups: int = 1, fold_bn: bool = False) -> str:
    """A bias-free square Conv ("same" padding for odd kernels) followed by inference BatchNormalization.

    With fold_bn the BN is folded into the conv's weight and bias instead. The weight and BN statistics are
    drawn identically either way, so both spellings compute the same function up to float rounding.
    """
    fan_in = cin // groups * kernel * kernel
    w = b.rng.standard_normal((cout, cin // groups, kernel, kernel)) / np.sqrt(fan_in)
    gamma = 1.0 + 0.1 * b.rng.standard_normal(cout)
    beta = 0.1 * b.rng.standard_normal(cout)
    mean = 0.1 * b.rng.standard_normal(cout)
    var = 1.0 + 0.1 * np.abs(b.rng.standard_normal(cout))
    attrs = dict(kernel_shape=[kernel, kernel], strides=[stride, stride], pads=[kernel // 2] * 4, group=groups)
    f32 = np.float32
    if fold_bn:
        scale = gamma / np.sqrt(var + BN_EPS)
        weight = b.const(f"{name}/weight", (w * scale[:, None, None, None]).astype(f32))
        bias = b.const(f"{name}/bias", (beta - mean * scale).astype(f32))
        return b.node("Conv", [x, weight, bias], name=name, **attrs)
    y = b.node("Conv", [x, b.const(f"{name}/weight", w.astype(f32))], name=name, **attrs)
    params = [b.const(f"{name}/bn_{p}", v.astype(f32))
              for p, v in (("gamma", gamma), ("beta", beta), ("mean", mean), ("var", var))]
    return b.node("BatchNormalization", [y, *params], name=f"{name}/bn", epsilon=BN_EPS)
