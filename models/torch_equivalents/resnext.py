"""ResNeXt (models/resnext.py) in torch.nn, laid out like torchvision's ResNet with grouped bottlenecks."""

from __future__ import annotations

import torch
from torch import nn

from models.resnext import EXPANSION
from models.torch_equivalents.common import ConvBN, OnnxWeights, conv_bn_state


class Bottleneck(nn.Module):
    """1x1 reduce, grouped 3x3 carrying the stride, 1x1 expand; a projection shortcut where the shape changes."""

    def __init__(self, cin: int, width: int, cout: int, stride: int, groups: int, folded: bool):
        super().__init__()
        self.conv1 = ConvBN(cin, width, 1, folded=folded)
        self.conv2 = ConvBN(width, width, 3, stride, groups=groups, folded=folded)
        self.conv3 = ConvBN(width, cout, 1, folded=folded)
        self.downsample = ConvBN(cin, cout, 1, stride, folded=folded) if stride != 1 or cin != cout else None
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.conv1(x))
        y = self.relu(self.conv2(y))
        y = self.conv3(y)
        return self.relu(y + (x if self.downsample is None else self.downsample(x)))


class ResNeXt(nn.Module):
    def __init__(self, depths: tuple[int, ...], cardinality: int, base_width: int, stem_channels: int,
                 num_classes: int, folded: bool):
        super().__init__()
        self.stem = nn.Sequential(ConvBN(3, stem_channels, 7, 2, folded=folded), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, padding=1))
        blocks, cin = [], stem_channels
        for s, depth in enumerate(depths):
            planes = stem_channels * 2 ** s
            width = planes * base_width // 64 * cardinality
            for i in range(depth):
                stride = 2 if s > 0 and i == 0 else 1
                blocks.append(Bottleneck(cin, width, planes * EXPANSION, stride, cardinality, folded))
                cin = planes * EXPANSION
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.blocks(self.stem(x))), 1))


def build(weights: OnnxWeights) -> tuple[nn.Module, dict]:
    folded = weights.has("stem/conv/bias")
    stem_channels = weights.shape("stem/conv/weight")[0]
    depths = []
    while (depth := weights.count(f"stage{len(depths)}/block{{}}/conv1/weight")) > 0:
        depths.append(depth)
    width, width_per_group = weights.shape("stage0/block0/conv2/weight")[:2]
    cardinality = width // width_per_group
    base_width = width * 64 // (stem_channels * cardinality)  # width = planes * base_width // 64 * cardinality
    num_classes = weights.shape("head/fc/weight")[0]
    module = ResNeXt(tuple(depths), cardinality, base_width, stem_channels, num_classes, folded)
    state = conv_bn_state(weights, "stem/conv", "stem.0", folded)
    index = 0
    for s, depth in enumerate(depths):
        for i in range(depth):
            p = f"stage{s}/block{i}"
            for conv in ("conv1", "conv2", "conv3", "downsample"):
                if conv != "downsample" or module.blocks[index].downsample is not None:
                    state |= conv_bn_state(weights, f"{p}/{conv}", f"blocks.{index}.{conv}", folded)
            index += 1
    state["fc.weight"] = weights["head/fc/weight"]  # Gemm with transB: already [classes, features]
    state["fc.bias"] = weights["head/fc/bias"]
    return module, state
