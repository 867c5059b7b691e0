"""ResNeXt-101 for ImageNet: bottleneck blocks whose 3x3 conv is grouped (cardinality groups).

The paper's Table 2 gives "#layers: 101, bottleneck width: 64d"; SOUFFLE's artifact builds the 3x3 convs as
64 groups of 4 channels at the first stage, i.e. ResNeXt-101 (64x4d), which is the default here. Set
cardinality=32 for the better-known 32x4d variant. `fold_bn` folds every BatchNormalization into its conv,
giving the inference graph a deployment tool would export; both spellings compute the same function.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

from models.common import GraphBuilder, conv_bn

EXPANSION = 4  # bottleneck output channels / planes


@dataclass(frozen=True)
class Config:
    depths: tuple[int, ...] = (3, 4, 23, 3)
    cardinality: int = 64
    base_width: int = 4  # channels per group at the first stage
    stem_channels: int = 64  # also the first stage's planes; each later stage doubles them
    num_classes: int = 1000
    image_size: int = 224
    batch: int = 1
    fold_bn: bool = False


PAPER = Config()
TINY = Config(depths=(2, 1, 1, 1), cardinality=4, base_width=8, stem_channels=16, num_classes=10, image_size=64)


def _bottleneck(b: GraphBuilder, x: str, name: str, cin: int, planes: int, stride: int, c: Config) -> str:
    """1x1 reduce, grouped 3x3 (carries the stride), 1x1 expand; projection shortcut where the shape changes."""
    width = planes * c.base_width // 64 * c.cardinality
    cout = planes * EXPANSION
    y = conv_bn(b, x, f"{name}/conv1", cin, width, 1, fold_bn=c.fold_bn)
    y = b.node("Relu", [y], name=f"{name}/relu1")
    y = conv_bn(b, y, f"{name}/conv2", width, width, 3, stride, groups=c.cardinality, fold_bn=c.fold_bn)
    y = b.node("Relu", [y], name=f"{name}/relu2")
    y = conv_bn(b, y, f"{name}/conv3", width, cout, 1, fold_bn=c.fold_bn)
    shortcut = x
    if stride != 1 or cin != cout:
        shortcut = conv_bn(b, x, f"{name}/downsample", cin, cout, 1, stride, fold_bn=c.fold_bn)
    y = b.node("Add", [y, shortcut], name=f"{name}/add")
    return b.node("Relu", [y], name=f"{name}/relu3")


def build(config: Config = PAPER, seed: int = 0) -> onnx.ModelProto:
    c = config
    if c.stem_channels * c.base_width // 64 < 1:
        raise ValueError("stem_channels * base_width must be at least 64 (at least one channel per group)")
    b = GraphBuilder("resnext", seed=seed, opset=17)
    x = b.input("input", [c.batch, 3, c.image_size, c.image_size])
    x = conv_bn(b, x, "stem/conv", 3, c.stem_channels, 7, 2, fold_bn=c.fold_bn)
    x = b.node("Relu", [x], name="stem/relu")
    x = b.node("MaxPool", [x], name="stem/maxpool", kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    cin = c.stem_channels
    for s, depth in enumerate(c.depths):
        planes = c.stem_channels * 2 ** s
        for i in range(depth):
            stride = 2 if s > 0 and i == 0 else 1
            x = _bottleneck(b, x, f"stage{s}/block{i}", cin, planes, stride, c)
            cin = planes * EXPANSION
    x = b.node("GlobalAveragePool", [x], name="head/pool")
    x = b.node("Flatten", [x], name="head/flatten", axis=1)
    w = b.weight("head/fc/weight", (c.num_classes, cin))
    bias = b.const("head/fc/bias", np.zeros(c.num_classes, np.float32))
    b.node("Gemm", [x, w, bias], name="output", transB=1)
    b.output("output", [c.batch, c.num_classes])
    return b.model()
