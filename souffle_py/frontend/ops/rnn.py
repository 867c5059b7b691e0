"""The ONNX LSTM operator (forward, layout 0), unrolled over time into per-step TEs.

The input projection of all steps is one GEMM; each step is then a recurrent GEMM h_{t-1} @ R^T plus two
elementwise TEs (the cell state and the hidden state), the same structure as the unrolled cell graph, so
the later passes (wavefront fusion, weight reuse across steps) see the same program for both spellings.
"""

from __future__ import annotations

import numpy as np
from tvm import te, tirx

from souffle_py.frontend.context import register
from souffle_py.frontend.ops.util import shape_of

DEFAULT_ACTIVATIONS = ["Sigmoid", "Tanh", "Tanh"]
GATES = {"i": 0, "o": 1, "f": 2, "c": 3}  # ONNX order of the four gate blocks in W, R and B


@register("LSTM", attributes=["hidden_size", "direction", "layout", "activations", "clip", "input_forget",
                              "activation_alpha", "activation_beta"])
def lower_lstm(ctx):
    _check_supported(ctx)
    x, w, r = ctx.tensor(0), ctx.tensor(1), ctx.tensor(2)
    steps, batch, input_size = shape_of(x)
    hidden = int(ctx.attr("hidden_size", shape_of(r)[-1]))
    if shape_of(w) != (1, 4 * hidden, input_size) or shape_of(r) != (1, 4 * hidden, hidden):
        raise ctx.unsupported(f"W {list(shape_of(w))} / R {list(shape_of(r))} do not match hidden_size "
                              f"{hidden} and input size {input_size} (one direction)")
    bias = _bias(ctx, hidden)
    k = te.reduce_axis((0, input_size), name="k")
    x_proj = te.compute((steps, batch, 4 * hidden),
                        lambda t, b, g: te.sum(x[t, b, k] * w[0, g, k], axis=k), name="x_proj")
    h = ctx.tensor(5) if ctx.has(5) else None
    c = ctx.tensor(6) if ctx.has(6) else None
    h_init = (lambda b, j: h[0, b, j]) if h is not None else None
    c_prev = (lambda b, j: c[0, b, j]) if c is not None else None
    h_prev = h_init
    hidden_states = []
    for t in range(steps):
        pre = _preactivation(x_proj, t, bias, r, h_prev, hidden, batch)
        cell, h_t = _step(pre, c_prev, hidden, batch, t)
        hidden_states.append(h_t)
        h_prev, c_prev = _reader(h_t), _reader(cell)
    y = te.compute((steps, 1, batch, hidden), lambda t, d, b, j: _select_step(hidden_states, t, b, j), name="y")
    y_h = te.compute((1, batch, hidden), lambda d, b, j: hidden_states[-1][b, j], name="y_h")
    y_c = te.compute((1, batch, hidden), lambda d, b, j: cell[b, j], name="y_c")
    return [y, y_h, y_c]


def _check_supported(ctx):
    if ctx.attr("direction", "forward") != "forward":
        raise ctx.unsupported(f"direction '{ctx.attr('direction')}' is not supported (only 'forward')")
    if ctx.attr("layout", 0) != 0:
        raise ctx.unsupported("layout=1 (batch-major) is not supported (only layout 0)")
    if ctx.attr("activations") and [a for a in ctx.attr("activations")] not in (
            DEFAULT_ACTIVATIONS, [a.encode() for a in DEFAULT_ACTIVATIONS]):
        raise ctx.unsupported(f"activations {ctx.attr('activations')} are not supported (only the default "
                              "Sigmoid, Tanh, Tanh)")
    for name in ("clip", "activation_alpha", "activation_beta"):
        if name in ctx.attrs:
            raise ctx.unsupported(f"attribute '{name}' is not supported")
    if ctx.attr("input_forget", 0):
        raise ctx.unsupported("input_forget=1 (coupled gates) is not supported")
    if ctx.has(7):
        raise ctx.unsupported("peephole weights (input P) are not supported")
    if ctx.has(4):
        steps, batch = ctx.shape(0)[:2]
        lens = ctx.const(4, "sequence_lens")
        if not (np.asarray(lens) == steps).all():
            raise ctx.unsupported("sequence_lens shorter than the sequence are not supported")


def _bias(ctx, hidden):
    """Wb + Rb as one [4H] tensor (folded at compile time when B is a constant), or None."""
    if not ctx.has(3):
        return None
    if ctx.is_const(3):
        b = np.asarray(ctx.const(3)).reshape(2, 4 * hidden)
        return ctx.new_param((b[0] + b[1]).astype(b.dtype), f"{ctx.node.input[3]}_sum")
    b = ctx.tensor(3)
    return te.compute((4 * hidden,), lambda g: b[0, g] + b[0, 4 * hidden + g], name="bias_sum")


def _preactivation(x_proj, t, bias, r, h_prev, hidden, batch):
    """g -> x_t W^T + h_{t-1} R^T + b, with the recurrent GEMM as its own TE (absent while h is zero)."""
    if h_prev is None:
        recurrent = None
    else:
        k = te.reduce_axis((0, hidden), name="k")
        recurrent = te.compute((batch, 4 * hidden), lambda b, g: te.sum(h_prev(b, k) * r[0, g, k], axis=k),
                               name=f"h_proj{t}")

    def pre(b, g):
        value = x_proj[t, b, g]
        if recurrent is not None:
            value = value + recurrent[b, g]
        return value + bias[g] if bias is not None else value

    return pre


def _step(pre, c_prev, hidden, batch, t):
    """The cell state c_t = f*c_{t-1} + i*g and hidden state h_t = o*tanh(c_t), one TE each."""

    def gate(name, b, j):
        return pre(b, GATES[name] * hidden + j)

    def cell_value(b, j):
        new = tirx.sigmoid(gate("i", b, j)) * tirx.tanh(gate("c", b, j))
        return new if c_prev is None else tirx.sigmoid(gate("f", b, j)) * c_prev(b, j) + new

    cell = te.compute((batch, hidden), cell_value, name=f"c{t}")
    h_t = te.compute((batch, hidden), lambda b, j: tirx.sigmoid(gate("o", b, j)) * tirx.tanh(cell[b, j]),
                     name=f"h{t}")
    return cell, h_t


def _reader(tensor):
    return lambda b, j: tensor[b, j]


def _select_step(hidden_states, t, b, j):
    """Y[t] = h_t, as a select chain over the steps (piecewise in t)."""
    value = hidden_states[-1][b, j]
    for step in range(len(hidden_states) - 2, -1, -1):
        value = tirx.Select(t == step, hidden_states[step][b, j], value)
    return value
