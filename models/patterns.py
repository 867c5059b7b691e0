"""Single-pattern CNN graphs at channel counts nobody wrote a rule for (issue 25): the convolution shapes
of RegNet, MobileNetV2 and V3, ShuffleNetV2, DenseNet and Inception exports, built with onnx.helper and seeded
weights. Tests use them small (tests/test_any_channels.py); scripts/bench_patterns.py times them at size
against ONNX Runtime.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from models.common import GraphBuilder


def _conv(b: GraphBuilder, x: str, cin: int, cout: int, kernel, groups: int = 1, stride: int = 1,
          bias: bool = True) -> str:
    kh, kw = (kernel, kernel) if isinstance(kernel, int) else kernel
    w = b.weight("w", [cout, cin // groups, kh, kw])
    inputs = [x, w] + ([b.weight("b", [cout], scale=0.1)] if bias else [])
    return b.node("Conv", inputs, kernel_shape=[kh, kw], strides=[stride, stride],
                  pads=[kh // 2, kw // 2, kh // 2, kw // 2], group=groups)


def _model(b: GraphBuilder, x: str, y: str, shape) -> tuple:
    """The model with output `y` (its shape from ONNX shape inference) and a seeded input for `x`."""
    graph = helper.make_graph(b.nodes, b.name, b.inputs, [helper.make_tensor_value_info(y, TensorProto.FLOAT, None)],
                              b.initializers)
    inferred = onnx.shape_inference.infer_shapes(helper.make_model(graph))
    dims = inferred.graph.output[0].type.tensor_type.shape.dim
    b.output(y, [d.dim_value for d in dims])
    return b.model(), {x: np.random.default_rng(1).standard_normal(shape).astype(np.float32)}


def conv_relu(channels: int, cout: int | None = None, kernel=1, size: int = 28, groups: int = 1, stride: int = 1):
    """Conv (+ bias) + ReLU: a 1x1, 3x3, grouped or asymmetric (1x7) conv over `channels`."""
    b = GraphBuilder(f"conv{channels}", seed=0)
    x = b.input("x", [1, channels, size, size])
    y = b.node("Relu", [_conv(b, x, channels, cout or channels, kernel, groups, stride)])
    return _model(b, x, y, (1, channels, size, size))


def asymmetric(channels: int = 128, size: int = 17):
    """Inception-v3's factorized 7x7: 1x7 then 7x1 convs with ReLU over an odd map."""
    b = GraphBuilder("asymmetric", seed=0)
    x = b.input("x", [1, channels, size, size])
    y = b.node("Relu", [_conv(b, x, channels, channels, (1, 7))])
    y = b.node("Relu", [_conv(b, y, channels, channels + 32, (7, 1))])
    return _model(b, x, y, (1, channels, size, size))


def _hard_swish(b: GraphBuilder, x: str) -> str:
    return b.node("HardSwish", [x])


def mobilenet_v3_block(cin: int = 40, expand: int = 120, cout: int = 40, size: int = 28, squeeze: int = 32):
    """MobileNetV3's inverted residual: 1x1 expand + hard-swish, 5x5 depthwise + hard-swish, squeeze-excite
    (pool, 1x1, ReLU, 1x1, hard-sigmoid, scale), 1x1 project, residual add."""
    b = GraphBuilder("mbv3", seed=0)
    x = b.input("x", [1, cin, size, size])
    y = _hard_swish(b, _conv(b, x, cin, expand, 1))
    y = _hard_swish(b, _conv(b, y, expand, expand, 5, groups=expand))
    s = b.node("GlobalAveragePool", [y])
    s = b.node("Relu", [_conv(b, s, expand, squeeze, 1)])
    s = b.node("HardSigmoid", [_conv(b, s, squeeze, expand, 1)], alpha=1 / 6, beta=0.5)
    y = b.node("Mul", [y, s])
    y = _conv(b, y, expand, cout, 1)
    if cin == cout:
        y = b.node("Add", [y, x])
    return _model(b, x, y, (1, cin, size, size))


def inverted_residuals(cin: int = 16, expand: int = 6, cout: int = 24, size: int = 56):
    """MobileNetV2's inverted residuals: 1x1 expand + ReLU6, 3x3 depthwise (stride 2) + ReLU6, 1x1 project to
    `cout` channels (24: no two-vector block divides it); then the same block at stride 1 with its residual."""
    b = GraphBuilder("mbv2", seed=0)
    x = b.input("x", [1, cin, size, size])
    y, channels = x, cin
    for stride in (2, 1):
        hidden = channels * expand
        relu6 = [b.const("lo", np.float32(0)), b.const("hi", np.float32(6))]
        h = b.node("Clip", [_conv(b, y, channels, hidden, 1), *relu6])
        h = b.node("Clip", [_conv(b, h, hidden, hidden, 3, groups=hidden, stride=stride), *relu6])
        h = _conv(b, h, hidden, cout, 1)
        y, channels = (b.node("Add", [h, y]) if stride == 1 else h), cout
    return _model(b, x, y, (1, cin, size, size))


def dense_block(cin: int = 64, growth: int = 32, layers: int = 3, size: int = 28):
    """DenseNet's dense block: each layer BN-free 1x1 (4 * growth) + ReLU, 3x3 (growth) + ReLU, concatenated
    onto its input (64, 96, 128, ... channels)."""
    b = GraphBuilder("dense", seed=0)
    x = b.input("x", [1, cin, size, size])
    y, channels = x, cin
    for _ in range(layers):
        h = b.node("Relu", [_conv(b, y, channels, 4 * growth, 1)])
        h = b.node("Relu", [_conv(b, h, 4 * growth, growth, 3)])
        y = b.node("Concat", [y, h], axis=1)
        channels += growth
    return _model(b, x, y, (1, cin, size, size))


def grouped_block(width: int = 104, group_width: int = 8, size: int = 28):
    """RegNetY's bottleneck at width 104: 1x1 + ReLU, 3x3 grouped (8 channels per group) + ReLU, 1x1,
    residual add + ReLU."""
    b = GraphBuilder("regnet", seed=0)
    x = b.input("x", [1, width, size, size])
    y = b.node("Relu", [_conv(b, x, width, width, 1)])
    y = b.node("Relu", [_conv(b, y, width, width, 3, groups=width // group_width)])
    y = b.node("Relu", [b.node("Add", [_conv(b, y, width, width, 1), x])])
    return _model(b, x, y, (1, width, size, size))


PATTERNS = {
    "pw104": lambda: conv_relu(104),
    "pw116": lambda: conv_relu(116, size=28),
    "pw58": lambda: conv_relu(58, size=28),
    "pw72": lambda: conv_relu(72, size=56),
    "pw120": lambda: conv_relu(120, size=28),
    "pw184": lambda: conv_relu(184, size=14),
    "c3x3_104": lambda: conv_relu(104, kernel=3),
    "c3x3_116": lambda: conv_relu(116, kernel=3, size=14),
    "grouped104": lambda: conv_relu(104, kernel=3, groups=13),
    "regnet104": lambda: grouped_block(),
    "mbv3": lambda: mobilenet_v3_block(),
    "dense": lambda: dense_block(),
    "asym17": lambda: asymmetric(128, 17),
    "asym35": lambda: asymmetric(64, 35),
    "pw128": lambda: conv_relu(128),
}
