"""The ONNX LSTM operator (forward, layout 0) as a recurrence over time (te_passes/recurrence.py).

The input projection of all steps is one GEMM; the step is a recurrent GEMV h_{t-1} @ R^T and two
elementwise TEs (the cell state and the hidden state), each over all T steps and reading the previous
step through a state placeholder. Codegen runs the three under one time loop in one kernel, so R stays in
cache across the steps and the kernel is compiled once, not once per step.
"""

from __future__ import annotations

import re

import numpy as np
from tvm import te, tirx

from souffle_py.frontend.context import register
from souffle_py.frontend.ops.util import shape_of
from te_passes.recurrence import MEMBER, STATE

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
    w_t, r_t = _gate_minor(ctx, 1), _gate_minor(ctx, 2)
    k = te.reduce_axis((0, input_size), name="k")
    x_proj = te.compute((steps, batch, 4 * hidden),
                        lambda t, b, g: te.sum(x[t, b, k] * w_t(k, g), axis=k), name="x_proj")
    dtype, prefix = str(x.dtype), re.sub(r"\W", "_", ctx.name)
    h_state = te.placeholder((steps, batch, hidden), dtype, name=f"{prefix}_h_state")
    c_state = te.placeholder((steps, batch, hidden), dtype, name=f"{prefix}_c_state")
    h_prev = _previous(h_state, ctx.tensor(5) if ctx.has(5) else None)
    c_prev = _previous(c_state, ctx.tensor(6) if ctx.has(6) else None)
    member = {MEMBER: ctx.name}
    kh = te.reduce_axis((0, hidden), name="k")
    h_proj = te.compute((steps, batch, 4 * hidden), lambda t, b, g: te.sum(h_prev(t, b, kh) * r_t(kh, g), axis=kh),
                        name="h_proj", attrs=member)

    def gate(name, t, b, j):
        g = GATES[name] * hidden + j
        value = x_proj[t, b, g] + h_proj[t, b, g]
        return value + bias[g] if bias is not None else value

    cell = te.compute((steps, batch, hidden),
                      lambda t, b, j: tirx.sigmoid(gate("f", t, b, j)) * c_prev(t, b, j)
                      + tirx.sigmoid(gate("i", t, b, j)) * tirx.tanh(gate("c", t, b, j)),
                      name="c", attrs={**member, STATE: c_state})
    h = te.compute((steps, batch, hidden), lambda t, b, j: tirx.sigmoid(gate("o", t, b, j)) * tirx.tanh(cell[t, b, j]),
                   name="h", attrs={**member, STATE: h_state})
    y = te.compute((steps, 1, batch, hidden), lambda t, d, b, j: h[t, b, j], name="y")
    y_h = te.compute((1, batch, hidden), lambda d, b, j: h[steps - 1, b, j], name="y_h")
    y_c = te.compute((1, batch, hidden), lambda d, b, j: cell[steps - 1, b, j], name="y_c")
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


def _gate_minor(ctx, index):
    """(k, g) -> W[0, g, k] (or R): a constant is stored transposed, [K, 4H], so that the gate axis the
    GEMMs vectorize is contiguous (read in place it is a gather, ~2x slower)."""
    if ctx.is_const(index):
        transposed = ctx.new_param(np.ascontiguousarray(np.asarray(ctx.const(index))[0].T),
                                   f"{ctx.node.input[index]}_T")
        return lambda k, g: transposed[k, g]
    tensor = ctx.tensor(index)
    return lambda k, g: tensor[0, g, k]


def _previous(state, initial):
    """(t, b, j) -> the value at step t - 1: the initial state (or zero) at t = 0, else state[t]."""
    def read(t, b, j):
        first = initial[0, b, j] if initial is not None else tirx.const(0.0, state.dtype)
        return tirx.if_then_else(t == 0, first, state[t, b, j])

    return read
