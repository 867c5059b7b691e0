"""A stacked bidirectional LSTM as torch.onnx exports `nn.LSTM(bidirectional=True)`: 2 layers, hidden 256,
100 steps; each layer's two directions concatenated for the next."""

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


PAPER = Config()
TINY = Config(hidden=16, input=16, steps=5)


def build(config: Config = PAPER, seed: int = 0) -> onnx.ModelProto:
    c = config
    return build_stack("bilstm", "LSTM", c.layers, c.hidden, c.input, c.steps, c.batch, "bidirectional", seed)
