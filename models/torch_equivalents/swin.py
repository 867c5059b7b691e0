"""Swin Transformer (models/swin.py) in torch.nn, written like the reference implementation and torchvision:
torch.roll for the shifted windows, a relative position bias table indexed per window, explicit attention.

The relative position index and the shifted-window masks are constants of the model; they are taken from
the ONNX initializers like the weights.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from models.swin import LN_EPS
from models.torch_equivalents.common import OnnxWeights, linear_state


def window_partition(x: torch.Tensor, window: int) -> torch.Tensor:
    """[B, H, W, C] -> [B * windows, window^2, C], windows in row-major order."""
    batch, height, width, channels = x.shape
    x = x.view(batch, height // window, window, width // window, window, channels)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, window * window, channels)


def window_reverse(x: torch.Tensor, window: int, height: int, width: int) -> torch.Tensor:
    """[B * windows, window^2, C] -> [B, H, W, C]."""
    channels = x.shape[-1]
    x = x.view(-1, height // window, width // window, window, window, channels)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, height, width, channels)


class WindowAttention(nn.Module):
    """Multi-head self-attention within each window, plus the learned relative position bias."""

    def __init__(self, dim: int, heads: int, window: int):
        super().__init__()
        self.heads = heads
        self.scale = (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * window - 1) ** 2, heads))
        self.register_buffer("relative_position_index", torch.zeros(window ** 4, dtype=torch.int64))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """x [B * windows, N, C]; mask [1, windows, 1, N, N] (additive) or None."""
        windows, n, dim = x.shape
        q, k, v = self.qkv(x).view(windows, n, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q * self.scale) @ k.transpose(-2, -1)
        bias = self.relative_position_bias_table[self.relative_position_index].view(n, n, self.heads)
        scores = scores + bias.permute(2, 0, 1)
        if mask is not None:
            per_image = mask.shape[1]
            scores = (scores.view(-1, per_image, self.heads, n, n) + mask).view(windows, self.heads, n, n)
        context = scores.softmax(dim=-1) @ v
        return self.proj(context.transpose(1, 2).reshape(windows, n, dim))


class SwinBlock(nn.Module):
    """(Shifted-)window attention and an exact-GELU MLP, both pre-LayerNorm with residuals; x is [B, H, W, C]."""

    def __init__(self, dim: int, heads: int, window: int, shift: int, mlp_ratio: int, mask_shape=None):
        super().__init__()
        self.window, self.shift = window, shift
        self.norm1 = nn.LayerNorm(dim, eps=LN_EPS)
        self.attn = WindowAttention(dim, heads, window)
        self.norm2 = nn.LayerNorm(dim, eps=LN_EPS)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_ratio * dim), nn.GELU(), nn.Linear(mlp_ratio * dim, dim))
        self.register_buffer("attn_mask", torch.zeros(mask_shape) if shift else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, height, width, _ = x.shape
        y = self.norm1(x)
        if self.shift:
            y = torch.roll(y, shifts=(-self.shift, -self.shift), dims=(1, 2))
        y = self.attn(window_partition(y, self.window), self.attn_mask)
        y = window_reverse(y, self.window, height, width)
        if self.shift:
            y = torch.roll(y, shifts=(self.shift, self.shift), dims=(1, 2))
        x = x + y
        return x + self.mlp(self.norm2(x))


class PatchMerging(nn.Module):
    """Concatenate each 2x2 neighbourhood's tokens, LayerNorm, project 4C -> 2C."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(4 * dim, eps=LN_EPS)
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], dim=-1)
        return self.reduction(self.norm(x))


class Swin(nn.Module):
    """`stages`: per stage, (depth, heads, window, shift of the odd blocks, resolution in tokens)."""

    def __init__(self, patch_size: int, embed_dim: int, stages, mlp_ratio: int, num_classes: int):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, embed_dim, patch_size, stride=patch_size)
        self.patch_norm = nn.LayerNorm(embed_dim, eps=LN_EPS)
        layers, dim = [], embed_dim
        for s, (depth, heads, window, shift, resolution) in enumerate(stages):
            mask_shape = (1, (resolution // window) ** 2, 1, window * window, window * window)
            layers += [SwinBlock(dim, heads, window, shift if i % 2 else 0, mlp_ratio, mask_shape)
                       for i in range(depth)]
            if s + 1 < len(stages):
                layers.append(PatchMerging(dim))
                dim *= 2
        self.layers = nn.Sequential(*layers)
        self.norm = nn.LayerNorm(dim, eps=LN_EPS)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_norm(self.patch_embed(x).permute(0, 2, 3, 1))
        x = self.norm(self.layers(x))
        return self.head(x.mean(dim=(1, 2)))


def _stages(weights: OnnxWeights, tokens: int) -> list[tuple[int, int, int, int, int]]:
    """(depth, heads, window, shift, resolution) per stage; shifted windows only where a window is smaller
    than the map, as models/swin.py (and Swin) do."""
    stages = []
    while (depth := weights.count(f"stage{len(stages)}/block{{}}/norm1/gamma")) > 0:
        rows, heads = weights.shape(f"stage{len(stages)}/block0/attn/position_bias/table")
        window = (math.isqrt(rows) + 1) // 2  # the table has (2 * window - 1)^2 rows
        resolution = tokens // 2 ** len(stages)
        stages.append((depth, heads, window, window // 2 if window < resolution else 0, resolution))
    return stages


def _block_state(weights: OnnxWeights, p: str, t: str, shift: int, resolution: int) -> dict:
    state = {}
    for onnx_name, torch_name in (("norm1", "norm1"), ("norm2", "norm2")):
        state[f"{t}.{torch_name}.weight"] = weights[f"{p}/{onnx_name}/gamma"]
        state[f"{t}.{torch_name}.bias"] = weights[f"{p}/{onnx_name}/beta"]
    for onnx_name, torch_name in (("attn/qkv", "attn.qkv"), ("attn/proj", "attn.proj"), ("fc1", "mlp.0"),
                                  ("fc2", "mlp.2")):
        state |= linear_state(weights, f"{p}/{onnx_name}/weight", f"{p}/{onnx_name}/bias", f"{t}.{torch_name}")
    table = f"{p}/attn/position_bias/table"
    window = (math.isqrt(weights.shape(table)[0]) + 1) // 2
    state[f"{t}.attn.relative_position_bias_table"] = weights[table]
    state[f"{t}.attn.relative_position_index"] = weights[f"relative_position_index_w{window}"]
    if shift:
        state[f"{t}.attn_mask"] = weights[f"attn_mask_r{resolution}"]
    return state


def build(weights: OnnxWeights) -> tuple[nn.Module, dict]:
    embed_dim, _, patch_size, _ = weights.shape("patch_embed/conv/weight")
    _, _, image_size, _ = weights.input_shapes[0]
    stages = _stages(weights, image_size // patch_size)
    mlp_ratio = weights.shape("stage0/block0/fc1/weight")[1] // embed_dim
    num_classes = weights.shape("head/fc/weight")[1]
    module = Swin(patch_size, embed_dim, stages, mlp_ratio, num_classes)
    state = {"patch_embed.weight": weights["patch_embed/conv/weight"],
             "patch_embed.bias": weights["patch_embed/conv/bias"],
             "patch_norm.weight": weights["patch_embed/norm/gamma"],
             "patch_norm.bias": weights["patch_embed/norm/beta"]}
    index = 0
    for s, (depth, _, _, shift, resolution) in enumerate(stages):
        for i in range(depth):
            state |= _block_state(weights, f"stage{s}/block{i}", f"layers.{index}", shift if i % 2 else 0,
                                  resolution)
            index += 1
        if s + 1 < len(stages):
            state[f"layers.{index}.norm.weight"] = weights[f"stage{s}/merge/norm/gamma"]
            state[f"layers.{index}.norm.bias"] = weights[f"stage{s}/merge/norm/beta"]
            state |= linear_state(weights, f"stage{s}/merge/reduction/weight", None, f"layers.{index}.reduction")
            index += 1
    state["norm.weight"], state["norm.bias"] = weights["head/norm/gamma"], weights["head/norm/beta"]
    state |= linear_state(weights, "head/fc/weight", "head/fc/bias", "head")
    return module, state
