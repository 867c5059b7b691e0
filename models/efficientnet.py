"""EfficientNet-b0 (Tan & Le, 2019): MBConv blocks with squeeze-and-excitation, as the paper evaluates it.

Its MBConv block (expand, depthwise, squeeze-excite, project) is the sub-module of the paper's Figures 5-6.
SiLU is spelled x * Sigmoid(x), as exporters emit it; "same" padding is symmetric (k // 2), as in PyTorch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

from models.common import GraphBuilder, conv_bn

# (expand ratio, kernel, stride of the first block, output channels, blocks), from the EfficientNet paper.
B0_STAGES = (
    (1, 3, 1, 16, 1),
    (6, 3, 2, 24, 2),
    (6, 5, 2, 40, 2),
    (6, 3, 2, 80, 3),
    (6, 5, 1, 112, 3),
    (6, 5, 2, 192, 4),
    (6, 3, 1, 320, 1),
)


@dataclass(frozen=True)
class Config:
    stages: tuple[tuple[int, int, int, int, int], ...] = B0_STAGES
    stem_channels: int = 32
    head_channels: int = 1280
    se_ratio: float = 0.25  # squeezed channels relative to the block's input channels
    num_classes: int = 1000
    image_size: int = 224
    batch: int = 1


PAPER = Config()
TINY = Config(stages=((1, 3, 1, 8, 1), (6, 3, 2, 12, 2), (6, 5, 2, 16, 2)), stem_channels=8,
              head_channels=32, num_classes=10, image_size=32)


def _silu(b: GraphBuilder, x: str, name: str) -> str:
    return b.node("Mul", [x, b.node("Sigmoid", [x], name=f"{name}/sigmoid")], name=name)


def _conv_bias(b: GraphBuilder, x: str, name: str, cin: int, cout: int) -> str:
    """1x1 conv with bias on a 1x1 map: the squeeze-excite's fully connected layers."""
    w = b.weight(f"{name}/weight", (cout, cin, 1, 1))
    bias = b.weight(f"{name}/bias", (cout,), scale=0.1)
    return b.node("Conv", [x, w, bias], name=name, kernel_shape=[1, 1])


def _squeeze_excite(b: GraphBuilder, x: str, name: str, channels: int, squeezed: int) -> str:
    s = b.node("GlobalAveragePool", [x], name=f"{name}/pool")
    s = _silu(b, _conv_bias(b, s, f"{name}/reduce", channels, squeezed), f"{name}/silu")
    s = b.node("Sigmoid", [_conv_bias(b, s, f"{name}/expand", squeezed, channels)], name=f"{name}/gate")
    return b.node("Mul", [x, s], name=f"{name}/scale")


def _mbconv(b: GraphBuilder, x: str, name: str, cin: int, cout: int, expand: int, kernel: int, stride: int,
            se_ratio: float) -> str:
    hidden = cin * expand
    y = x
    if expand != 1:
        y = _silu(b, conv_bn(b, y, f"{name}/expand", cin, hidden, 1), f"{name}/expand/silu")
    y = conv_bn(b, y, f"{name}/depthwise", hidden, hidden, kernel, stride, groups=hidden)
    y = _silu(b, y, f"{name}/depthwise/silu")
    y = _squeeze_excite(b, y, f"{name}/se", hidden, max(1, int(cin * se_ratio)))
    y = conv_bn(b, y, f"{name}/project", hidden, cout, 1)
    if stride == 1 and cin == cout:
        y = b.node("Add", [y, x], name=f"{name}/add")
    return y


def build(config: Config = PAPER, seed: int = 0) -> onnx.ModelProto:
    c = config
    b = GraphBuilder("efficientnet", seed=seed, opset=17)
    x = b.input("input", [c.batch, 3, c.image_size, c.image_size])
    x = _silu(b, conv_bn(b, x, "stem/conv", 3, c.stem_channels, 3, 2), "stem/silu")
    cin = c.stem_channels
    for s, (expand, kernel, stride, cout, blocks) in enumerate(c.stages):
        for i in range(blocks):
            x = _mbconv(b, x, f"stage{s}/block{i}", cin, cout, expand, kernel, stride if i == 0 else 1,
                        c.se_ratio)
            cin = cout
    x = _silu(b, conv_bn(b, x, "head/conv", cin, c.head_channels, 1), "head/silu")
    x = b.node("GlobalAveragePool", [x], name="head/pool")
    x = b.node("Flatten", [x], name="head/flatten", axis=1)
    w = b.weight("head/fc/weight", (c.num_classes, c.head_channels))
    bias = b.const("head/fc/bias", np.zeros(c.num_classes, np.float32))
    b.node("Gemm", [x, w, bias], name="output", transB=1)
    b.output("output", [c.batch, c.num_classes])
    return b.model()
