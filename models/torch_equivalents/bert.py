"""BERT encoder (models/bert.py) in torch.nn, attention through F.scaled_dot_product_attention as in
Hugging Face's BERT; both ONNX LayerNorm spellings map to nn.LayerNorm."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.bert import LN_EPS
from models.torch_equivalents.common import OnnxWeights, linear_state


class BertLayer(nn.Module):
    """Post-LayerNorm transformer layer: self-attention and an exact-GELU FFN, each with a residual."""

    def __init__(self, hidden: int, heads: int, ffn: int):
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value = (nn.Linear(hidden, hidden) for _ in range(3))
        self.attention_output = nn.Linear(hidden, hidden)
        self.attention_norm = nn.LayerNorm(hidden, eps=LN_EPS)
        self.intermediate = nn.Linear(hidden, ffn)
        self.output = nn.Linear(ffn, hidden)
        self.output_norm = nn.LayerNorm(hidden, eps=LN_EPS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape

        def heads(projection: nn.Linear) -> torch.Tensor:
            return projection(x).view(batch, seq, self.heads, hidden // self.heads).transpose(1, 2)

        context = F.scaled_dot_product_attention(heads(self.query), heads(self.key), heads(self.value))
        context = context.transpose(1, 2).reshape(batch, seq, hidden)
        x = self.attention_norm(x + self.attention_output(context))
        return self.output_norm(x + self.output(F.gelu(self.intermediate(x))))


class BertEncoder(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, ffn: int):
        super().__init__()
        self.layers = nn.ModuleList(BertLayer(hidden, heads, ffn) for _ in range(layers))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return hidden_states


def build(weights: OnnxWeights) -> tuple[nn.Module, dict]:
    layers = weights.count("layer{}/attn/q_w")
    hidden, ffn = weights.shape("layer0/ffn/fc1_w")
    heads = int(weights["heads_shape"][2])  # the Reshape target [batch, seq, heads, head_dim]
    module = BertEncoder(layers, hidden, heads, ffn)
    state = {}
    for i in range(layers):
        p, t = f"layer{i}", f"layers.{i}"
        for onnx_name, torch_name in (("attn/q", "query"), ("attn/k", "key"), ("attn/v", "value"),
                                      ("attn/out", "attention_output"), ("ffn/fc1", "intermediate"),
                                      ("ffn/fc2", "output")):
            state |= linear_state(weights, f"{p}/{onnx_name}_w", f"{p}/{onnx_name}_b", f"{t}.{torch_name}")
        for onnx_name, torch_name in (("attn/ln", "attention_norm"), ("ffn/ln", "output_norm")):
            state[f"{t}.{torch_name}.weight"] = weights[f"{p}/{onnx_name}/gamma"]
            state[f"{t}.{torch_name}.bias"] = weights[f"{p}/{onnx_name}/beta"]
    return module, state
