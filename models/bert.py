"""BERT encoder (BERT-base by default) as exported from PyTorch: attention, Erf-GELU FFN and LayerNorm.

LayerNorm comes in two spellings because exporters emit either the primitive reduction chain or the
fused LayerNormalization op, and the compiler must handle both.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

from models.common import GraphBuilder

LAYERNORM_SPELLINGS = ("primitive", "op")
LN_EPS = 1e-12  # BERT's value


@dataclass(frozen=True)
class Config:
    layers: int = 12
    hidden: int = 768
    heads: int = 12
    ffn: int = 3072
    seq: int = 128
    batch: int = 1
    layernorm: str = "primitive"


PAPER = Config()
TINY = Config(layers=2, hidden=64, heads=4, ffn=128, seq=16)


class _Bert:
    """Holds the builder and the constants shared by every layer, so each is stored once."""

    def __init__(self, config: Config, seed: int):
        if config.layernorm not in LAYERNORM_SPELLINGS:
            raise ValueError(f"layernorm must be one of {LAYERNORM_SPELLINGS}, got {config.layernorm!r}")
        if config.layers < 1:
            raise ValueError(f"layers must be at least 1, got {config.layers}")
        if config.hidden % config.heads:
            raise ValueError(f"hidden ({config.hidden}) must be divisible by heads ({config.heads})")
        self.c = config
        self.b = GraphBuilder("bert", seed=seed, opset=17)
        c, b = config, self.b
        dh = c.hidden // c.heads
        self.heads_shape = b.const("heads_shape", np.array([c.batch, c.seq, c.heads, dh], np.int64))
        self.hidden_shape = b.const("hidden_shape", np.array([c.batch, c.seq, c.hidden], np.int64))
        self.sqrt_dh = b.const("sqrt_head_dim", np.float32(np.sqrt(dh)))
        self.sqrt2 = b.const("sqrt2", np.float32(np.sqrt(2.0)))
        self.one = b.const("one", np.float32(1.0))
        self.half = b.const("half", np.float32(0.5))
        if config.layernorm == "primitive":
            self.two = b.const("two", np.float32(2.0))
            self.eps = b.const("ln_eps", np.float32(LN_EPS))

    def linear(self, x: str, fan_in: int, fan_out: int, prefix: str) -> str:
        """MatMul + bias with weights scaled by 1/sqrt(fan_in), so activations keep unit scale."""
        b = self.b
        w = b.weight(f"{prefix}_w", (fan_in, fan_out), scale=1.0 / np.sqrt(fan_in))
        bias = b.weight(f"{prefix}_b", (fan_out,), scale=0.02)
        y = b.node("MatMul", [x, w], name=f"{prefix}_matmul")
        return b.node("Add", [y, bias], name=f"{prefix}_bias")

    def layernorm(self, x: str, prefix: str, out: str | None = None) -> str:
        b, h = self.b, self.c.hidden
        gamma = b.const(f"{prefix}/gamma", (1.0 + 0.1 * b.rng.standard_normal(h)).astype(np.float32))
        beta = b.const(f"{prefix}/beta", (0.1 * b.rng.standard_normal(h)).astype(np.float32))
        if self.c.layernorm == "op":
            return b.node("LayerNormalization", [x, gamma, beta], name=out or f"{prefix}/layernorm",
                          axis=-1, epsilon=LN_EPS)
        mean = b.node("ReduceMean", [x], name=f"{prefix}/mean", axes=[-1], keepdims=1)
        centered = b.node("Sub", [x, mean], name=f"{prefix}/sub")
        sq = b.node("Pow", [centered, self.two], name=f"{prefix}/pow")
        var = b.node("ReduceMean", [sq], name=f"{prefix}/var", axes=[-1], keepdims=1)
        var_eps = b.node("Add", [var, self.eps], name=f"{prefix}/add_eps")
        std = b.node("Sqrt", [var_eps], name=f"{prefix}/sqrt")
        normed = b.node("Div", [centered, std], name=f"{prefix}/div")
        scaled = b.node("Mul", [normed, gamma], name=f"{prefix}/mul_gamma")
        return b.node("Add", [scaled, beta], name=out or f"{prefix}/add_beta")

    def attention(self, x: str, p: str) -> str:
        b, h = self.b, self.c.hidden

        def heads(name: str, perm: list[int]) -> str:
            y = self.linear(x, h, h, f"{p}/{name}")
            y = b.node("Reshape", [y, self.heads_shape], name=f"{p}/{name}_reshape")
            return b.node("Transpose", [y], name=f"{p}/{name}_transpose", perm=perm)

        q = heads("q", [0, 2, 1, 3])
        k = heads("k", [0, 2, 3, 1])
        v = heads("v", [0, 2, 1, 3])
        scores = b.node("MatMul", [q, k], name=f"{p}/scores")
        scores = b.node("Div", [scores, self.sqrt_dh], name=f"{p}/scale")
        probs = b.node("Softmax", [scores], name=f"{p}/softmax", axis=-1)
        ctx = b.node("MatMul", [probs, v], name=f"{p}/context")
        ctx = b.node("Transpose", [ctx], name=f"{p}/context_transpose", perm=[0, 2, 1, 3])
        ctx = b.node("Reshape", [ctx, self.hidden_shape], name=f"{p}/context_reshape")
        return self.linear(ctx, h, h, f"{p}/out")

    def ffn(self, x: str, p: str) -> str:
        b, c = self.b, self.c
        y = self.linear(x, c.hidden, c.ffn, f"{p}/fc1")
        erf = b.node("Erf", [b.node("Div", [y, self.sqrt2], name=f"{p}/gelu_div")], name=f"{p}/gelu_erf")
        erf1 = b.node("Add", [erf, self.one], name=f"{p}/gelu_add")
        half = b.node("Mul", [y, self.half], name=f"{p}/gelu_half")
        gelu = b.node("Mul", [half, erf1], name=f"{p}/gelu_mul")
        return self.linear(gelu, c.ffn, c.hidden, f"{p}/fc2")

    def build(self) -> onnx.ModelProto:
        b, c = self.b, self.c
        shape = [c.batch, c.seq, c.hidden]
        x = b.input("hidden_states", shape)
        for i in range(c.layers):
            p = f"layer{i}"
            attn = b.node("Add", [x, self.attention(x, f"{p}/attn")], name=f"{p}/attn/residual")
            x = self.layernorm(attn, f"{p}/attn/ln")
            ffn = b.node("Add", [x, self.ffn(x, f"{p}/ffn")], name=f"{p}/ffn/residual")
            x = self.layernorm(ffn, f"{p}/ffn/ln", out="output" if i == c.layers - 1 else None)
        b.output(x, shape)
        return b.model()


def build(config: Config = PAPER, seed: int = 0) -> onnx.ModelProto:
    """A BERT encoder stack; both LayerNorm spellings draw the same weights, so they compute the same function."""
    return _Bert(config, seed).build()
