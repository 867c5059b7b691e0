"""The stacked LSTM (models/lstm.py, either spelling) as one nn.LSTM, which runs on cuDNN on a GPU.

ONNX stores the gates in the order i, o, f, c; torch in i, f, g (= c), o. The unrolled spelling keeps
transposed weights and one summed bias, which goes to bias_ih with bias_hh zero.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from models.torch_equivalents.common import OnnxWeights

ONNX_TO_TORCH_GATES = (0, 2, 3, 1)  # torch's i, f, g, o blocks taken from ONNX's i, o, f, c


def _torch_gate_order(value: np.ndarray) -> np.ndarray:
    """Reorder the 4 * hidden gate blocks along the first axis."""
    blocks = np.split(value, 4, axis=0)
    return np.concatenate([blocks[i] for i in ONNX_TO_TORCH_GATES], axis=0)


class StackedLSTM(nn.Module):
    """Forward LSTM over x [steps, batch, input] from zero state; returns every step's last-layer h."""

    def __init__(self, input_size: int, hidden: int, layers: int):
        super().__init__()
        self.lstm = nn.LSTM(input_size, hidden, num_layers=layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lstm(x)[0]


def _layer_weights(weights: OnnxWeights, layer: int) -> tuple[np.ndarray, ...]:
    """(W [4H, in], R [4H, H], input bias, recurrent bias) of one layer, in ONNX gate order."""
    p = f"layer{layer}"
    if weights.has(f"{p}/W"):  # the LSTM-op spelling
        bias = weights[f"{p}/B"][0]
        return weights[f"{p}/W"][0], weights[f"{p}/R"][0], *np.split(bias, 2)
    bias = weights[f"{p}/bias"]  # unrolled: W_T, R_T and W_b + R_b
    return weights[f"{p}/W_T"].T, weights[f"{p}/R_T"].T, bias, np.zeros_like(bias)


def build(weights: OnnxWeights) -> tuple[nn.Module, dict]:
    op_spelling = weights.has("layer0/W")
    layers = weights.count("layer{}/W" if op_spelling else "layer{}/W_T")
    _, _, input_size = weights.input_shapes[0]  # x is [steps, batch, input]
    hidden = weights.shape("layer0/R")[-1] if op_spelling else weights.shape("layer0/R_T")[0]
    module = StackedLSTM(input_size, hidden, layers)
    state = {}
    for layer in range(layers):
        values = _layer_weights(weights, layer)
        for torch_name, value in zip(("weight_ih", "weight_hh", "bias_ih", "bias_hh"), values):
            state[f"lstm.{torch_name}_l{layer}"] = _torch_gate_order(value)
    return module, state
