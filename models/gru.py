"""A stacked GRU as torch.onnx exports `nn.GRU` (linear_before_reset=1): 2 layers, hidden 256, 100 steps."""

from __future__ import annotations

from dataclasses import dataclass

import onnx

from models.recurrent_stack import build_stack


@dataclass(frozen=True)
class Config:
    layers: int = 2
    hidden: int = 256
    input: int = 256
    steps: int = 100
    batch: int = 1
    linear_before_reset: int = 1


PAPER = Config()
TINY = Config(hidden=16, input=16, steps=5)


def build(config: Config = PAPER, seed: int = 0) -> onnx.ModelProto:
    c = config
    return build_stack("gru", "GRU", c.layers, c.hidden, c.input, c.steps, c.batch, "forward", seed,
                       linear_before_reset=c.linear_before_reset)
