"""Small ONNX graphs of convolution patterns for the CUDA grid-stage tests (seeded weights)."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper


class Graph:
    """A builder of one-input, one-output graphs over NCHW float32 maps."""

    def __init__(self, channels: int, size: int, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.nodes, self.inits = [], []
        self.input = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, channels, size, size])
        self.shape = {"x": (channels, size, size)}

    def _name(self, prefix: str) -> str:
        return f"{prefix}{len(self.nodes)}"

    def conv(self, x: str, filters: int, kernel: int = 3, stride: int = 1, pad: int | None = None,
             groups: int = 1, bias: bool = True) -> str:
        channels, size, _ = self.shape[x]
        pad = kernel // 2 if pad is None else pad
        name = self._name("conv")
        weight = self.rng.standard_normal((filters, channels // groups, kernel, kernel)).astype(np.float32)
        self.inits.append(numpy_helper.from_array(weight * (2.0 / (channels // groups * kernel * kernel)) ** 0.5,
                                                  f"{name}_w"))
        inputs = [x, f"{name}_w"]
        if bias:
            self.inits.append(numpy_helper.from_array(self.rng.standard_normal(filters).astype(np.float32) * 0.1,
                                                      f"{name}_b"))
            inputs.append(f"{name}_b")
        self.nodes.append(helper.make_node("Conv", inputs, [name], kernel_shape=[kernel, kernel], pads=[pad] * 4,
                                           strides=[stride] * 2, group=groups))
        self.shape[name] = (filters, (size + 2 * pad - kernel) // stride + 1, 0)
        self.shape[name] = (filters, self.shape[name][1], self.shape[name][1])
        return name

    def op(self, op_type: str, *inputs: str) -> str:
        name = self._name(op_type.lower())
        self.nodes.append(helper.make_node(op_type, list(inputs), [name]))
        self.shape[name] = self.shape[inputs[0]]
        return name

    def model(self, output: str):
        channels, size, _ = self.shape[output]
        graph = helper.make_graph(self.nodes, "g", [self.input],
                                  [helper.make_tensor_value_info(output, TensorProto.FLOAT, [1, channels, size, size])],
                                  self.inits)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
