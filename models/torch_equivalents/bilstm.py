"""The stacked bidirectional LSTM (models/bilstm.py) as one nn.LSTM(bidirectional=True): its output
[T, B, 2H] is the forward then the reverse direction, as the ONNX model's Transpose + Reshape make it."""

from __future__ import annotations

from torch import nn

from models.torch_equivalents.common import OnnxWeights
from models.torch_equivalents.gru import StackedRecurrence, stack_state
from models.torch_equivalents.lstm import ONNX_TO_TORCH_GATES


def build(weights: OnnxWeights) -> tuple[nn.Module, dict]:
    input_size, hidden, layers, state = stack_state(weights, ONNX_TO_TORCH_GATES, 2)
    return StackedRecurrence(nn.LSTM(input_size, hidden, num_layers=layers, bidirectional=True)), state
