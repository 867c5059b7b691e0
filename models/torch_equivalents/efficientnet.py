"""EfficientNet (models/efficientnet.py) in torch.nn: MBConv blocks with squeeze-and-excitation and SiLU,
as torchvision writes EfficientNet-b0 (without stochastic depth, an identity at inference)."""

from __future__ import annotations

from fractions import Fraction

import torch
from torch import nn

from models.torch_equivalents.common import ConvBN, OnnxWeights, conv_bn_state


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int, squeezed: int):
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.reduce = nn.Conv2d(channels, squeezed, 1)
        self.expand = nn.Conv2d(squeezed, channels, 1)
        self.silu = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(self.expand(self.silu(self.reduce(self.pool(x)))))


class MBConv(nn.Module):
    """Optional 1x1 expand, depthwise conv (carrying the stride), squeeze-excite, 1x1 project, residual."""

    def __init__(self, cin: int, cout: int, expand: int, kernel: int, stride: int, squeezed: int):
        super().__init__()
        hidden = cin * expand
        self.expand = nn.Sequential(ConvBN(cin, hidden, 1), nn.SiLU()) if expand != 1 else nn.Identity()
        self.depthwise = nn.Sequential(ConvBN(hidden, hidden, kernel, stride, groups=hidden), nn.SiLU())
        self.se = SqueezeExcite(hidden, squeezed)
        self.project = ConvBN(hidden, cout, 1)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.project(self.se(self.depthwise(self.expand(x))))
        return y + x if self.residual else y


class EfficientNet(nn.Module):
    """`stages`: (expand ratio, kernel, stride of the first block, output channels, blocks) per stage."""

    def __init__(self, stages, stem_channels: int, head_channels: int, se_ratio: float | Fraction,
                 num_classes: int):
        super().__init__()
        self.stem = nn.Sequential(ConvBN(3, stem_channels, 3, 2), nn.SiLU())
        blocks, cin = [], stem_channels
        for expand, kernel, stride, cout, count in stages:
            for i in range(count):
                squeezed = max(1, int(cin * se_ratio))
                blocks.append(MBConv(cin, cout, expand, kernel, stride if i == 0 else 1, squeezed))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Sequential(ConvBN(cin, head_channels, 1), nn.SiLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(head_channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.head(self.blocks(self.stem(x))))


def _stages(weights: OnnxWeights, stem_channels: int) -> list[tuple[int, int, int, int, int]]:
    """The stage table, from the block weights and each stage's first depthwise Conv stride."""
    stages, cin = [], stem_channels
    while (count := weights.count(f"stage{len(stages)}/block{{}}/depthwise/weight")) > 0:
        p = f"stage{len(stages)}/block0"
        hidden, _, kernel, _ = weights.shape(f"{p}/depthwise/weight")
        stride = weights.attribute(f"{p}/depthwise", "strides")[0]
        cout = weights.shape(f"{p}/project/weight")[0]
        stages.append((hidden // cin, kernel, stride, cout, count))
        cin = cout
    return stages


def _se_ratio(weights: OnnxWeights, stages, stem_channels: int) -> Fraction:
    """A ratio giving every block the squeezed width max(1, int(cin * ratio)) it has in the ONNX model.

    The largest squeezed / cin over the blocks not clamped to 1 lies between that and the builder's own
    ratio, so it floors to the same widths; squeezed / stem_channels alone can floor differently later.
    """
    ratios, cin = [], stem_channels
    for s, (_, _, _, cout, count) in enumerate(stages):
        for i in range(count):
            squeezed = weights.shape(f"stage{s}/block{i}/se/reduce/weight")[0]
            if squeezed > 1:
                ratios.append(Fraction(squeezed, cin))
            cin = cout
    return max(ratios, default=Fraction(0))


def build(weights: OnnxWeights) -> tuple[nn.Module, dict]:
    stem_channels = weights.shape("stem/conv/weight")[0]
    stages = _stages(weights, stem_channels)
    se_ratio = _se_ratio(weights, stages, stem_channels)
    head_channels = weights.shape("head/conv/weight")[0]
    num_classes = weights.shape("head/fc/weight")[0]
    module = EfficientNet(stages, stem_channels, head_channels, se_ratio, num_classes)
    state = conv_bn_state(weights, "stem/conv", "stem.0")
    index = 0
    for s, (expand, *_, count) in enumerate(stages):
        for i in range(count):
            p, t = f"stage{s}/block{i}", f"blocks.{index}"
            if expand != 1:
                state |= conv_bn_state(weights, f"{p}/expand", f"{t}.expand.0")
            state |= conv_bn_state(weights, f"{p}/depthwise", f"{t}.depthwise.0")
            state |= conv_bn_state(weights, f"{p}/project", f"{t}.project")
            for conv in ("reduce", "expand"):
                state[f"{t}.se.{conv}.weight"] = weights[f"{p}/se/{conv}/weight"]
                state[f"{t}.se.{conv}.bias"] = weights[f"{p}/se/{conv}/bias"]
            index += 1
    state |= conv_bn_state(weights, "head/conv", "head.0")
    state["fc.weight"] = weights["head/fc/weight"]  # Gemm with transB: already [classes, features]
    state["fc.bias"] = weights["head/fc/bias"]
    return module, state
