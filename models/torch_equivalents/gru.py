"""The stacked GRU (models/gru.py) as one nn.GRU. ONNX stores the gates z, r, h; torch r, z, n. torch's GRU
applies the reset gate after the recurrent projection: the ONNX model's linear_before_reset=1."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from models.torch_equivalents.common import OnnxWeights
from souffle_py.errors import SouffleError

ONNX_TO_TORCH_GATES = (1, 0, 2)  # torch's r, z, n blocks taken from ONNX's z, r, h


def torch_gate_order(value: np.ndarray, order) -> np.ndarray:
    blocks = np.split(value, len(order), axis=0)
    return np.concatenate([blocks[i] for i in order], axis=0)


class StackedRecurrence(nn.Module):
    """A torch recurrent stack over x [steps, batch, input] from zero state; returns every step's output."""

    def __init__(self, rnn: nn.Module):
        super().__init__()
        self.rnn = rnn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]


def stack_state(weights: OnnxWeights, order, directions: int) -> tuple[int, int, int, dict]:
    """(input size, hidden, layers, torch state dict) of a models/recurrent_stack.py model."""
    layers = weights.count("layer{}/W")
    _, _, input_size = weights.input_shapes[0]
    hidden = weights.shape("layer0/R")[-1]
    state = {}
    for layer in range(layers):
        p = f"layer{layer}"
        w, r, b = weights[f"{p}/W"], weights[f"{p}/R"], weights[f"{p}/B"]
        for d in range(directions):
            suffix = f"l{layer}" + ("_reverse" if d else "")
            wb, rb = np.split(b[d], 2)
            for torch_name, value in zip(("weight_ih", "weight_hh", "bias_ih", "bias_hh"), (w[d], r[d], wb, rb)):
                state[f"rnn.{torch_name}_{suffix}"] = torch_gate_order(value, order)
    return input_size, hidden, layers, state


def build(weights: OnnxWeights) -> tuple[nn.Module, dict]:
    if int(weights.attribute("layer0/gru", "linear_before_reset")) != 1:
        raise SouffleError("torch's nn.GRU computes linear_before_reset=1 only; this GRU model uses 0")
    input_size, hidden, layers, state = stack_state(weights, ONNX_TO_TORCH_GATES, 1)
    return StackedRecurrence(nn.GRU(input_size, hidden, num_layers=layers)), state
