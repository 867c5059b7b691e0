"""Swin Transformer (Liu et al., 2021), Swin-B by default: the paper evaluates the base model, patch 4, window 7.

Spelled with the primitive ops an exporter emits, so the compiler sees every data movement: window partition
and reverse are Reshape/Transpose, the shifted-window roll is Slice+Concat, the relative position bias is a
Gather of a learned table, and the shifted-window mask is a constant added to the attention scores. Tokens
stay in [batch, height, width, channels] layout between blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

from models.common import GraphBuilder

LN_EPS = 1e-5
MASK_VALUE = -100.0  # the reference implementation's score for token pairs from different regions


@dataclass(frozen=True)
class Config:
    image_size: int = 224
    patch_size: int = 4
    embed_dim: int = 128
    depths: tuple[int, ...] = (2, 2, 18, 2)
    num_heads: tuple[int, ...] = (4, 8, 16, 32)
    window_size: int = 7
    mlp_ratio: int = 4
    num_classes: int = 1000
    batch: int = 1


PAPER = Config()
TINY = Config(image_size=64, embed_dim=32, depths=(2, 2), num_heads=(2, 4), window_size=4, num_classes=10)


def relative_position_index(window: int) -> np.ndarray:
    """[window^2 * window^2] int64: for each query/key pair, the row of the bias table for their offset."""
    coords = np.stack(np.meshgrid(np.arange(window), np.arange(window), indexing="ij")).reshape(2, -1)
    rel = (coords[:, :, None] - coords[:, None, :]).transpose(1, 2, 0) + (window - 1)
    return (rel[..., 0] * (2 * window - 1) + rel[..., 1]).reshape(-1).astype(np.int64)


def shifted_window_mask(resolution: int, window: int, shift: int) -> np.ndarray:
    """[1, windows, 1, N, N] float32: MASK_VALUE where a rolled window mixes tokens from different regions."""
    bounds = (slice(0, -window), slice(-window, -shift), slice(-shift, None))
    regions = np.zeros((resolution, resolution))
    for label, (rows, cols) in enumerate((r, c) for r in bounds for c in bounds):
        regions[rows, cols] = label
    n = resolution // window
    windows = regions.reshape(n, window, n, window).transpose(0, 2, 1, 3).reshape(n * n, window * window)
    mask = np.where(windows[:, None, :] != windows[:, :, None], MASK_VALUE, 0.0)
    return mask[None, :, None].astype(np.float32)


def _stage_geometry(c: Config, stage: int) -> tuple[int, int, int]:
    """(resolution, window, shift) of a stage; a window as large as the map is used unshifted, as in Swin."""
    resolution = c.image_size // c.patch_size // 2 ** stage
    if resolution <= c.window_size:
        return resolution, resolution, 0
    return resolution, c.window_size, c.window_size // 2


def _validate(c: Config) -> None:
    if len(c.depths) != len(c.num_heads):
        raise ValueError("depths and num_heads must have one entry per stage")
    if c.image_size % c.patch_size:
        raise ValueError(f"image_size {c.image_size} is not a multiple of patch_size {c.patch_size}")
    for s, heads in enumerate(c.num_heads):
        resolution, window, _ = _stage_geometry(c, s)
        if resolution * 2 ** s * c.patch_size != c.image_size or resolution % window:
            raise ValueError(f"stage {s}: {resolution}x{resolution} tokens do not tile into {window}x{window} "
                             "windows (or do not halve evenly between stages)")
        if c.embed_dim * 2 ** s % heads:
            raise ValueError(f"stage {s}: {c.embed_dim * 2 ** s} channels do not split into {heads} heads")


class _Swin:
    """Holds the builder and caches the integer constants (shapes, slice bounds) and masks blocks share."""

    def __init__(self, c: Config, seed: int):
        _validate(c)
        self.c = c
        self.b = GraphBuilder("swin", seed=seed, opset=17)
        self._ints: dict[tuple[int, ...], str] = {}
        self._masks: dict[int, str] = {}
        self._indices: dict[int, str] = {}
        self.inv_sqrt2 = self.b.const("inv_sqrt2", np.float32(1.0 / np.sqrt(2.0)))
        self.one = self.b.const("one", np.float32(1.0))
        self.half = self.b.const("half", np.float32(0.5))

    def ints(self, *values: int) -> str:
        if values not in self._ints:
            self._ints[values] = self.b.const("ints_" + "_".join(map(str, values)), np.array(values, np.int64))
        return self._ints[values]

    def reshape(self, x: str, name: str, *shape: int) -> str:
        return self.b.node("Reshape", [x, self.ints(*shape)], name=name)

    def linear(self, x: str, name: str, cin: int, cout: int, bias: bool = True) -> str:
        b = self.b
        y = b.node("MatMul", [x, b.weight(f"{name}/weight", (cin, cout), scale=1.0 / np.sqrt(cin))], name=name)
        if not bias:
            return y
        return b.node("Add", [y, b.weight(f"{name}/bias", (cout,), scale=0.02)], name=f"{name}/bias_add")

    def layernorm(self, x: str, name: str, dim: int) -> str:
        b = self.b
        gamma = b.const(f"{name}/gamma", (1.0 + 0.1 * b.rng.standard_normal(dim)).astype(np.float32))
        beta = b.const(f"{name}/beta", (0.1 * b.rng.standard_normal(dim)).astype(np.float32))
        return b.node("LayerNormalization", [x, gamma, beta], name=name, axis=-1, epsilon=LN_EPS)

    def gelu(self, x: str, name: str) -> str:
        """Exact GELU, x * 0.5 * (1 + erf(x / sqrt 2)), as PyTorch exports nn.GELU."""
        b = self.b
        e = b.node("Erf", [b.node("Mul", [x, self.inv_sqrt2], name=f"{name}/scale")], name=f"{name}/erf")
        e = b.node("Add", [e, self.one], name=f"{name}/add_one")
        return b.node("Mul", [b.node("Mul", [x, self.half], name=f"{name}/half"), e], name=name)

    def roll(self, x: str, name: str, shift: int, size: int) -> str:
        """Cyclic roll of the two spatial axes by -shift (torch.roll(x, -shift, (1, 2))) as Slice+Concat."""
        b = self.b
        for axis, label in ((1, "h"), (2, "w")):
            head = b.node("Slice", [x, self.ints(shift), self.ints(size), self.ints(axis)],
                          name=f"{name}/{label}_head")
            tail = b.node("Slice", [x, self.ints(0), self.ints(shift), self.ints(axis)],
                          name=f"{name}/{label}_tail")
            x = b.node("Concat", [head, tail], name=f"{name}/{label}_concat", axis=axis)
        return x

    def partition(self, x: str, name: str, resolution: int, window: int, dim: int) -> str:
        """[B, H, W, C] -> [B * windows, window^2, C]."""
        n, batch = resolution // window, self.c.batch
        x = self.reshape(x, f"{name}/split", batch, n, window, n, window, dim)
        x = self.b.node("Transpose", [x], name=f"{name}/transpose", perm=[0, 1, 3, 2, 4, 5])
        return self.reshape(x, f"{name}/merge", batch * n * n, window * window, dim)

    def reverse(self, x: str, name: str, resolution: int, window: int, dim: int) -> str:
        """[B * windows, window^2, C] -> [B, H, W, C]."""
        n, batch = resolution // window, self.c.batch
        x = self.reshape(x, f"{name}/split", batch, n, n, window, window, dim)
        x = self.b.node("Transpose", [x], name=f"{name}/transpose", perm=[0, 1, 3, 2, 4, 5])
        return self.reshape(x, f"{name}/merge", batch, resolution, resolution, dim)

    def position_bias(self, name: str, window: int, heads: int) -> str:
        """[heads, N, N]: this block's learned table gathered by the (shared, constant) offset index."""
        b, n = self.b, window * window
        if window not in self._indices:
            self._indices[window] = b.const(f"relative_position_index_w{window}", relative_position_index(window))
        table = b.weight(f"{name}/table", ((2 * window - 1) ** 2, heads), scale=0.1)
        bias = b.node("Gather", [table, self._indices[window]], name=f"{name}/gather", axis=0)
        bias = self.reshape(bias, f"{name}/reshape", n, n, heads)
        return b.node("Transpose", [bias], name=f"{name}/transpose", perm=[2, 0, 1])

    def attention(self, x: str, name: str, resolution: int, window: int, shift: int, dim: int, heads: int) -> str:
        """Multi-head self-attention within each window; x is [B * windows, N, C]."""
        b, n = self.b, window * window
        windows = self.c.batch * (resolution // window) ** 2
        head_dim = dim // heads
        qkv = self.linear(x, f"{name}/qkv", dim, 3 * dim)
        q, k, v = b.node("Split", [qkv, self.ints(dim, dim, dim)], name=f"{name}/split", outputs=3, axis=-1)
        q, k, v = (self.reshape(t, f"{name}/{label}_heads", windows, n, heads, head_dim)
                   for t, label in ((q, "q"), (k, "k"), (v, "v")))
        q = b.node("Transpose", [q], name=f"{name}/q_transpose", perm=[0, 2, 1, 3])
        q = b.node("Mul", [q, b.const(f"{name}/scale", np.float32(head_dim ** -0.5))], name=f"{name}/q_scale")
        k = b.node("Transpose", [k], name=f"{name}/k_transpose", perm=[0, 2, 3, 1])
        v = b.node("Transpose", [v], name=f"{name}/v_transpose", perm=[0, 2, 1, 3])
        scores = b.node("MatMul", [q, k], name=f"{name}/scores")
        scores = b.node("Add", [scores, self.position_bias(f"{name}/position_bias", window, heads)],
                        name=f"{name}/add_position_bias")
        if shift:
            if resolution not in self._masks:
                self._masks[resolution] = b.const(f"attn_mask_r{resolution}",
                                                  shifted_window_mask(resolution, window, shift))
            per_image = windows // self.c.batch
            scores = self.reshape(scores, f"{name}/mask_split", self.c.batch, per_image, heads, n, n)
            scores = b.node("Add", [scores, self._masks[resolution]], name=f"{name}/add_mask")
            scores = self.reshape(scores, f"{name}/mask_merge", windows, heads, n, n)
        probs = b.node("Softmax", [scores], name=f"{name}/softmax", axis=-1)
        y = b.node("MatMul", [probs, v], name=f"{name}/context")
        y = b.node("Transpose", [y], name=f"{name}/context_transpose", perm=[0, 2, 1, 3])
        y = self.reshape(y, f"{name}/context_merge", windows, n, dim)
        return self.linear(y, f"{name}/proj", dim, dim)

    def block(self, x: str, name: str, stage: int, shifted: bool) -> str:
        c = self.c
        resolution, window, shift = _stage_geometry(c, stage)
        shift = shift if shifted else 0
        dim, heads = c.embed_dim * 2 ** stage, c.num_heads[stage]
        y = self.layernorm(x, f"{name}/norm1", dim)
        if shift:
            y = self.roll(y, f"{name}/roll", shift, resolution)
        y = self.partition(y, f"{name}/partition", resolution, window, dim)
        y = self.attention(y, f"{name}/attn", resolution, window, shift, dim, heads)
        y = self.reverse(y, f"{name}/reverse", resolution, window, dim)
        if shift:
            y = self.roll(y, f"{name}/unroll", resolution - shift, resolution)
        x = self.b.node("Add", [x, y], name=f"{name}/add1")
        y = self.layernorm(x, f"{name}/norm2", dim)
        y = self.gelu(self.linear(y, f"{name}/fc1", dim, c.mlp_ratio * dim), f"{name}/gelu")
        y = self.linear(y, f"{name}/fc2", c.mlp_ratio * dim, dim)
        return self.b.node("Add", [x, y], name=f"{name}/add2")

    def merge(self, x: str, name: str, resolution: int, dim: int) -> str:
        """Patch merging: concatenate each 2x2 neighbourhood's tokens, LayerNorm, project 4C -> 2C."""
        b, end = self.b, self.ints(resolution, resolution)
        axes, steps = self.ints(1, 2), self.ints(2, 2)
        parts = [b.node("Slice", [x, self.ints(dh, dw), end, axes, steps], name=f"{name}/slice_{dh}{dw}")
                 for dh, dw in ((0, 0), (1, 0), (0, 1), (1, 1))]
        x = b.node("Concat", parts, name=f"{name}/concat", axis=-1)
        x = self.layernorm(x, f"{name}/norm", 4 * dim)
        return self.linear(x, f"{name}/reduction", 4 * dim, 2 * dim, bias=False)

    def build(self) -> onnx.ModelProto:
        b, c = self.b, self.c
        x = b.input("input", [c.batch, 3, c.image_size, c.image_size])
        w = b.weight("patch_embed/conv/weight", (c.embed_dim, 3, c.patch_size, c.patch_size))
        bias = b.weight("patch_embed/conv/bias", (c.embed_dim,), scale=0.02)
        x = b.node("Conv", [x, w, bias], name="patch_embed/conv", kernel_shape=[c.patch_size] * 2,
                   strides=[c.patch_size] * 2)
        x = b.node("Transpose", [x], name="patch_embed/to_nhwc", perm=[0, 2, 3, 1])
        x = self.layernorm(x, "patch_embed/norm", c.embed_dim)
        for s, depth in enumerate(c.depths):
            for i in range(depth):
                x = self.block(x, f"stage{s}/block{i}", s, shifted=i % 2 == 1)
            if s + 1 < len(c.depths):
                x = self.merge(x, f"stage{s}/merge", _stage_geometry(c, s)[0], c.embed_dim * 2 ** s)
        dim = c.embed_dim * 2 ** (len(c.depths) - 1)
        x = self.layernorm(x, "head/norm", dim)
        x = b.node("ReduceMean", [x], name="head/pool", axes=[1, 2], keepdims=0)
        x = b.node("MatMul", [x, b.weight("head/fc/weight", (dim, c.num_classes), scale=1.0 / np.sqrt(dim))],
                   name="head/fc")
        b.node("Add", [x, b.const("head/fc/bias", np.zeros(c.num_classes, np.float32))], name="output")
        b.output("output", [c.batch, c.num_classes])
        return b.model()


def build(config: Config = PAPER, seed: int = 0) -> onnx.ModelProto:
    return _Swin(config, seed).build()
