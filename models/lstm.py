"""The SOUFFLE paper's stacked LSTM, as ONNX LSTM ops or unrolled into one cell graph per layer and time step.

The unrolled spelling exposes the layer x time-step wavefront to the compiler: layer l+1 at step t reads
layer l's h_t directly, not a concatenated sequence, so no artificial barrier separates the layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

from models.common import GraphBuilder

SPELLINGS = ("op", "unrolled")


@dataclass(frozen=True)
class Config:
    layers: int = 10
    hidden: int = 256
    input: int = 256
    steps: int = 100
    batch: int = 1
    spelling: str = "op"


PAPER = Config()
TINY = Config(layers=2, hidden=16, input=16, steps=5)


def _draw_layer(rng: np.random.Generator, fan_in: int, hidden: int):
    """W [4H, I], R [4H, H], Wb [4H], Rb [4H] in ONNX gate order i, o, f, c.

    PyTorch's uniform(+-1/sqrt(H)) makes the paper's 10-layer output independent of the input (changes
    ~1e-6), which would hide compiler bugs. N(0, 2/sqrt(I)) input and N(0, 1/sqrt(H)) recurrent weights keep
    the output input-dependent while the recurrence stays contractive, so float32 rounding does not grow
    over the 100 steps (larger recurrent weights turn chaotic). Both spellings call this in the same order,
    so they hold the same weights for the same seed.
    """
    def normal(scale, *shape):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    return (normal(2.0 / np.sqrt(fan_in), 4 * hidden, fan_in), normal(1.0 / np.sqrt(hidden), 4 * hidden, hidden),
            normal(0.1, 4 * hidden), normal(0.1, 4 * hidden))


def _op_layer(b: GraphBuilder, x: str, c: Config, layer: int, fan_in: int, out: str | None) -> str:
    w, r, wb, rb = _draw_layer(b.rng, fan_in, c.hidden)
    p = f"layer{layer}"
    w = b.const(f"{p}/W", w[None])
    r = b.const(f"{p}/R", r[None])
    bias = b.const(f"{p}/B", np.concatenate([wb, rb])[None])
    y = b.node("LSTM", [x, w, r, bias], name=f"{p}/lstm", hidden_size=c.hidden, direction="forward", layout=0)
    axes = b.const(f"{p}/squeeze_axes", np.array([1], np.int64))
    return b.node("Squeeze", [y, axes], name=out or f"{p}/squeeze")


def _unrolled_layer(b: GraphBuilder, xs: list[str], c: Config, layer: int, fan_in: int,
                    split_sizes: str) -> list[str]:
    """One cell per time step; returns the h_t names. At t=0 h and c are zero, so recurrent terms are skipped."""
    w, r, wb, rb = _draw_layer(b.rng, fan_in, c.hidden)
    p = f"layer{layer}"
    w_t = b.const(f"{p}/W_T", np.ascontiguousarray(w.T))
    r_t = b.const(f"{p}/R_T", np.ascontiguousarray(r.T))
    bias = b.const(f"{p}/bias", wb + rb)
    hs: list[str] = []
    h = cell = None
    for t, x in enumerate(xs):
        q = f"{p}/t{t}"
        gates = b.node("MatMul", [x, w_t], name=f"{q}/x_matmul")
        if h is not None:
            gates = b.node("Add", [gates, b.node("MatMul", [h, r_t], name=f"{q}/h_matmul")], name=f"{q}/add_h")
        gates = b.node("Add", [gates, bias], name=f"{q}/add_bias")
        i, o, f, g = b.node("Split", [gates, split_sizes], name=f"{q}/split", outputs=4, axis=-1)
        i = b.node("Sigmoid", [i], name=f"{q}/i")
        o = b.node("Sigmoid", [o], name=f"{q}/o")
        f = b.node("Sigmoid", [f], name=f"{q}/f")
        g = b.node("Tanh", [g], name=f"{q}/g")
        c_t = b.node("Mul", [i, g], name=f"{q}/i_g")
        if cell is not None:
            c_t = b.node("Add", [b.node("Mul", [f, cell], name=f"{q}/f_c"), c_t], name=f"{q}/c_add")
        cell = c_t
        h = b.node("Mul", [o, b.node("Tanh", [cell], name=f"{q}/c_tanh")], name=f"{q}/h")
        hs.append(h)
    return hs


def build(config: Config = PAPER, seed: int = 0) -> onnx.ModelProto:
    """A stacked forward LSTM over x [steps, batch, input]; output is the last layer's h sequence."""
    c = config
    if c.spelling not in SPELLINGS:
        raise ValueError(f"spelling must be one of {SPELLINGS}, got {c.spelling!r}")
    if c.layers < 1 or c.steps < 1:
        raise ValueError(f"layers and steps must be at least 1, got {c.layers} and {c.steps}")
    b = GraphBuilder("lstm", seed=seed, opset=17)
    x = b.input("x", [c.steps, c.batch, c.input])
    fan_ins = [c.input] + [c.hidden] * (c.layers - 1)
    if c.spelling == "op":
        for layer, fan_in in enumerate(fan_ins):
            x = _op_layer(b, x, c, layer, fan_in, out="output" if layer == c.layers - 1 else None)
    else:
        axis0 = b.const("axis0", np.array([0], np.int64))
        parts = b.node("Split", [x, b.const("step_sizes", np.ones(c.steps, np.int64))], name="x_split",
                       outputs=c.steps, axis=0)
        parts = parts if isinstance(parts, list) else [parts]  # node() returns a bare name for one output
        xs = [b.node("Squeeze", [part, axis0], name=f"x_t{t}") for t, part in enumerate(parts)]
        split_sizes = b.const("gate_sizes", np.full(4, c.hidden, np.int64))
        for layer, fan_in in enumerate(fan_ins):
            xs = _unrolled_layer(b, xs, c, layer, fan_in, split_sizes)
        ys = [b.node("Unsqueeze", [h, axis0], name=f"y_t{t}") for t, h in enumerate(xs)]
        b.node("Concat", ys, name="output", axis=0)
    b.output("output", [c.steps, c.batch, c.hidden])
    return b.model()
