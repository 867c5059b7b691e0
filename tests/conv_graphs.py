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

    def conv(self, x: str, filters: int, kernel: int | tuple = 3, stride: int = 1, pad: int | tuple | None = None,
             groups: int = 1, bias: bool = True) -> str:
        """A convolution of `x`; `kernel` and `pad` one size or (rows, columns): 'same' padding by default."""
        channels, size, _ = self.shape[x]
        kh, kw = (kernel, kernel) if isinstance(kernel, int) else kernel
        ph, pw = ((kh // 2, kw // 2) if pad is None else (pad, pad) if isinstance(pad, int) else pad)
        name = self._name("conv")
        weight = self.rng.standard_normal((filters, channels // groups, kh, kw)).astype(np.float32)
        self.inits.append(numpy_helper.from_array(weight * (2.0 / (channels // groups * kh * kw)) ** 0.5,
                                                  f"{name}_w"))
        inputs = [x, f"{name}_w"]
        if bias:
            self.inits.append(numpy_helper.from_array(self.rng.standard_normal(filters).astype(np.float32) * 0.1,
                                                      f"{name}_b"))
            inputs.append(f"{name}_b")
        self.nodes.append(helper.make_node("Conv", inputs, [name], kernel_shape=[kh, kw], pads=[ph, pw, ph, pw],
                                           strides=[stride] * 2, group=groups))
        rows = (size + 2 * ph - kh) // stride + 1
        assert rows == (size + 2 * pw - kw) // stride + 1, "square maps only"
        self.shape[name] = (filters, rows, rows)
        return name

    def concat(self, *inputs: str) -> str:
        """The maps `inputs` stacked along their channels."""
        name = self._name("concat")
        self.nodes.append(helper.make_node("Concat", list(inputs), [name], axis=1))
        _, size, _ = self.shape[inputs[0]]
        self.shape[name] = (sum(self.shape[x][0] for x in inputs), size, size)
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
