"""ONNX's recurrent operators LSTM, GRU and RNN as one recurrence form (souffle_py/ir/marks.py).

Every cell is lowered the same way; only its gate equations differ (cells.py):
- the input projection of all steps and directions is one GEMM over X in its own time order;
- a step is one recurrent GEMV h_{t-1} @ R^T over all gates (GRU with linear_before_reset=0: over z and
  r, then a second one of r * h_{t-1}) and element-wise state TEs, each over all T steps, reading the
  previous step through a state placeholder. Codegen runs them under one time loop in one kernel, so R
  stays in cache across steps and the kernel is compiled once, not once per step;
- a bidirectional node is one recurrence with a direction axis [T, 2, B, H] (the reverse direction reads
  its input from the end): both directions in every step of one time loop, horizontally fused;
- sequence_lens: row b steps only while t < lens[b]; later steps keep the state and give zeros in Y (the
  reverse direction starts at lens[b] - 1); layout 1 only changes how X, the initial states and the
  outputs are indexed.
"""

from __future__ import annotations

import re

import numpy as np
from tvm import te, tirx

from souffle_py.frontend.context import register
from souffle_py.frontend.ops import cells
from souffle_py.frontend.ops.util import shape_of
from souffle_py.ir.marks import MEMBER, STATE

COMMON = ["hidden_size", "direction", "layout", "activations", "clip", "activation_alpha", "activation_beta"]
DIRECTIONS = {"forward": ("forward",), "reverse": ("reverse",), "bidirectional": ("forward", "reverse")}


@register("LSTM", attributes=COMMON + ["input_forget"])
def lower_lstm(ctx):
    return _Recurrence(ctx, cells.LSTM).lower()


@register("GRU", attributes=COMMON + ["linear_before_reset"])
def lower_gru(ctx):
    return _Recurrence(ctx, cells.GRU).lower()


@register("RNN", attributes=COMMON)
def lower_rnn(ctx):
    return _Recurrence(ctx, cells.RNN).lower()


class _Recurrence:
    """One recurrent node's TEs. Step TEs are over [T, (D,) B, H]: the direction axis only when there are
    two (a one-direction node has the same TEs as the LSTM had before bidirectional support)."""

    def __init__(self, ctx, cell: cells.Cell):
        self.ctx, self.cell = ctx, cell
        direction = ctx.attr("direction", "forward")
        if direction not in DIRECTIONS:
            raise ctx.unsupported(f"direction '{direction}' is not one of forward, reverse, bidirectional")
        self.directions = DIRECTIONS[direction]
        self.layout = int(ctx.attr("layout", 0))
        if self.layout not in (0, 1):
            raise ctx.unsupported(f"layout={self.layout} (only 0 and 1 exist)")
        x_shape = shape_of(ctx.tensor(0))
        if len(x_shape) != 3:
            raise ctx.unsupported(f"X has shape {list(x_shape)}, expected rank 3")
        self.steps, self.batch, self.input_size = \
            (x_shape if self.layout == 0 else (x_shape[1], x_shape[0], x_shape[2]))
        dirs, gates = len(self.directions), cell.num_gates
        self.hidden = int(ctx.attr("hidden_size", shape_of(ctx.tensor(2))[-1]))
        w_shape, r_shape = shape_of(ctx.tensor(1)), shape_of(ctx.tensor(2))
        width = gates * self.hidden
        if w_shape != (dirs, width, self.input_size) or r_shape != (dirs, width, self.hidden):
            raise ctx.unsupported(f"W {list(w_shape)} / R {list(r_shape)} do not match hidden_size {self.hidden}, "
                                  f"input size {self.input_size} and {dirs} direction(s)")
        self.dtype = str(ctx.tensor(0).dtype)
        self.prefix = re.sub(r"\W", "_", ctx.name)
        self.clip = float(ctx.attr("clip")) if "clip" in ctx.attrs else None
        self.input_forget = bool(ctx.attr("input_forget", 0))
        self.linear_before_reset = bool(ctx.attr("linear_before_reset", 0))
        self.acts = self._activations()
        self.lens = self._sequence_lens()

    # --- shapes and indices ----------------------------------------------------------------------------
    @property
    def two(self) -> bool:
        return len(self.directions) == 2

    def step_shape(self, width):
        return (self.steps, *((2,) if self.two else ()), self.batch, width)

    def named(self, fn, last="j"):
        """`fn(*indices)` with the TE axes named t, (d,) b and `last`: the LSTM's kernels as before."""
        if self.two:
            return {"j": lambda t, d, b, j: fn(t, d, b, j), "g": lambda t, d, b, g: fn(t, d, b, g)}[last]
        return {"j": lambda t, b, j: fn(t, b, j), "g": lambda t, b, g: fn(t, b, g)}[last]

    def split(self, idx):
        """(t, d, b, j) from a step TE's indices (d = 0 for one direction)."""
        return (idx[0], idx[1], idx[2], idx[3]) if self.two else (idx[0], 0, idx[1], idx[2])

    def at(self, tensor, t, d, b, j):
        return tensor[t, d, b, j] if self.two else tensor[t, b, j]

    def length(self, b):
        return self.lens[b].astype("int32") if self.lens is not None else tirx.const(self.steps, "int32")

    def time_of(self, t, d, b):
        """The input position step t of direction d processes (the reverse direction counts down from its
        row's length)."""
        def of(direction):
            if direction == "forward":
                return t
            back = self.length(b) - 1 - t
            return tirx.max(back, 0) if self.lens is not None else back
        if not self.two:
            return of(self.directions[0])
        return tirx.if_then_else(d == 0, of("forward"), of("reverse"))

    def masked(self, t, b, value, otherwise):
        """`value` where row b is still stepping at t, else `otherwise`."""
        if self.lens is None:
            return value
        return tirx.if_then_else(t < self.length(b), value, otherwise)

    def per_direction(self, d, choose):
        """choose(direction index) -> callable; the two directions' callables selected by d."""
        if not self.two:
            return choose(0)
        first, second = choose(0), choose(1)
        if first == second:
            return first
        return lambda x: tirx.if_then_else(d == 0, first(x), second(x))

    # --- attributes and inputs ------------------------------------------------------------------------
    def _activations(self):
        ctx, n = self.ctx, len(self.cell.default_activations)
        names = list(ctx.attrs.get("activations") or []) or list(self.cell.default_activations) * len(self.directions)
        if len(names) != n * len(self.directions):
            raise ctx.unsupported(f"activations {[str(a) for a in names]}: expected {n} per direction")
        found = cells.activations(names, ctx.attrs.get("activation_alpha"), ctx.attrs.get("activation_beta"),
                                  lambda name: ctx.unsupported(f"activation function '{name}' is not one the "
                                                               "ONNX specification lists"))
        return [found[i * n:(i + 1) * n] for i in range(len(self.directions))]

    def _sequence_lens(self):
        ctx = self.ctx
        if not ctx.has(4):
            return None
        if ctx.is_const(4):
            lens = np.asarray(ctx.const(4)).reshape(-1).astype(np.int64)
            if lens.shape != (self.batch,) or lens.min() < 0 or lens.max() > self.steps:
                raise ctx.unsupported(f"sequence_lens {lens.tolist()} must hold one length in [0, {self.steps}] "
                                      f"per batch row ({self.batch})")
            if (lens == self.steps).all():
                return None
            return ctx.new_param(lens.astype(np.int32), f"{ctx.node.input[4]}_lens")
        lens = ctx.tensor(4)
        if shape_of(lens) != (self.batch,):
            raise ctx.unsupported(f"sequence_lens has shape {list(shape_of(lens))}, expected [{self.batch}]")
        return lens

    def weights(self, index):
        """(d, k, g) -> W[d, g, k] (or R): a constant is stored transposed, [(D,) K, G*H], so that the gate
        axis the GEMMs vectorize is contiguous (read in place it is a gather, ~2x slower)."""
        ctx = self.ctx
        if ctx.is_const(index):
            value = np.asarray(ctx.const(index))
            stored = np.ascontiguousarray(value.transpose(0, 2, 1) if self.two else value[0].T)
            param = ctx.new_param(stored, f"{ctx.node.input[index]}_T")
            return (lambda d, k, g: param[d, k, g]) if self.two else (lambda d, k, g: param[k, g])
        tensor = ctx.tensor(index)
        return lambda d, k, g: tensor[d, g, k]

    def biases(self):
        """(input-side bias (d, g) -> value or None, recurrent bias of the GRU's h gate (d, j) or None).
        Wb + Rb is folded into one vector, except Rb_h of a GRU with linear_before_reset, which the reset
        gate scales."""
        ctx, width = self.ctx, self.cell.num_gates * self.hidden
        if not ctx.has(3):
            return None, None
        split_h = self.cell is cells.GRU and self.linear_before_reset
        keep = width - self.hidden if split_h else width
        if ctx.is_const(3):
            b = np.asarray(ctx.const(3)).reshape(len(self.directions), 2, width)
            summed = b[:, 0].copy()
            summed[:, :keep] += b[:, 1, :keep]
            param = ctx.new_param((summed if self.two else summed[0]).astype(b.dtype), f"{ctx.node.input[3]}_sum")
            x_side = (lambda d, g: param[d, g]) if self.two else (lambda d, g: param[g])
        else:
            tensor = ctx.tensor(3)
            x_side = lambda d, g: tirx.if_then_else(g < keep, tensor[d, g] + tensor[d, width + g], tensor[d, g]) \
                if split_h else tensor[d, g] + tensor[d, width + g]
        if not split_h:
            return x_side, None
        recurrent_h = ctx.tensor(3)
        return x_side, lambda d, j: recurrent_h[d, 2 * width - self.hidden + j]

    def peepholes(self):
        """(d, gate name) -> (j -> P weight) for i, o, f; None without P."""
        ctx = self.ctx
        if self.cell is not cells.LSTM or not ctx.has(7):
            return None
        p = ctx.tensor(7)
        order = {"i": 0, "o": 1, "f": 2}
        return lambda d, name, j: p[d, order[name] * self.hidden + j]

    def initial(self, index):
        """(d, b, j) -> the initial state (layout-aware), or None for zeros."""
        if not self.ctx.has(index):
            return None
        tensor = self.ctx.tensor(index)
        return (lambda d, b, j: tensor[d, b, j]) if self.layout == 0 else (lambda d, b, j: tensor[b, d, j])

    def previous(self, state, initial):
        """(t, d, b, j) -> the state at step t - 1: the initial state (or zero) at t = 0."""
        def read(t, d, b, j):
            first = initial(d, b, j) if initial is not None else tirx.const(0.0, self.dtype)
            return tirx.if_then_else(t == 0, first, self.at(state, t, d, b, j))
        return read

    # --- the TEs ---------------------------------------------------------------------------------------
    def lower(self):
        ctx, cell, hidden = self.ctx, self.cell, self.hidden
        x = ctx.tensor(0)
        w, r = self.weights(1), self.weights(2)
        x_bias, h_bias = self.biases()
        width = cell.num_gates * hidden
        k = te.reduce_axis((0, self.input_size), name="k")
        read_x = (lambda time, b, kk: x[time, b, kk]) if self.layout == 0 else (lambda time, b, kk: x[b, time, kk])

        def project_input(*idx):
            time, d, b, g = self.split(idx)
            return te.sum(read_x(time, b, k) * w(d, k, g), axis=k)
        x_proj = te.compute(self.step_shape(width), self.named(project_input, "g"), name="x_proj")

        member = {MEMBER: ctx.name}
        states = {name: te.placeholder(self.step_shape(hidden), self.dtype, name=f"{self.prefix}_{name}_state")
                  for name in cell.states}
        h_prev = self.previous(states["h"], self.initial(5))
        recurrent_width = 2 * hidden if cell is cells.GRU and not self.linear_before_reset else width
        kh = te.reduce_axis((0, hidden), name="k")

        def project_state(*idx):
            t, d, b, g = self.split(idx)
            return te.sum(h_prev(t, d, b, kh) * r(d, kh, g), axis=kh)
        h_proj = te.compute(self.step_shape(recurrent_width), self.named(project_state, "g"), name="h_proj",
                            attrs=member)

        def gate_sum(name, t, d, b, j, recurrent=True):
            g = cell.gates.index(name) * hidden + j
            value = self.at(x_proj, self.time_of(t, d, b), d, b, g)
            if recurrent:
                value = value + self.at(h_proj, t, d, b, g)
            return value + x_bias(d, g) if x_bias is not None else value

        clip = (lambda v: tirx.max(tirx.min(v, tirx.const(self.clip, self.dtype)), tirx.const(-self.clip, self.dtype))) \
            if self.clip is not None else (lambda v: v)

        def acts(d):
            return [self.per_direction(d, lambda i, n=n: self.acts[i][n]) for n in range(len(cell.default_activations))]

        if cell is cells.LSTM:
            return self._lstm(states, h_prev, gate_sum, clip, acts, member)
        if cell is cells.GRU:
            return self._gru(states, h_prev, gate_sum, clip, acts, member, h_proj, r, h_bias)
        return self._rnn(states, h_prev, gate_sum, clip, acts, member)

    def _lstm(self, states, h_prev, gate_sum, clip, acts, member):
        c_prev = self.previous(states["c"], self.initial(6))
        peephole = self.peepholes()
        shape = self.step_shape(self.hidden)

        def parts(t, d, b, j):
            weight = (lambda name: peephole(d, name, j) if name in ("i", "o", "f") else None) \
                if peephole is not None else (lambda name: None)
            return cells.lstm_cell(lambda name: gate_sum(name, t, d, b, j), c_prev(t, d, b, j), weight,
                                   acts(d), clip, self.input_forget)

        def cell_state(*idx):
            t, d, b, j = self.split(idx)
            return self.masked(t, b, parts(t, d, b, j)[0], c_prev(t, d, b, j))
        c = te.compute(shape, self.named(cell_state), name="c", attrs={**member, STATE: states["c"]})

        def hidden_state(*idx):
            t, d, b, j = self.split(idx)
            return self.masked(t, b, parts(t, d, b, j)[1](self.at(c, t, d, b, j)), h_prev(t, d, b, j))
        h = te.compute(shape, self.named(hidden_state), name="h", attrs={**member, STATE: states["h"]})
        return [self.sequence_output(h), self.last(h, "y_h"), self.last(c, "y_c")]

    def _gru(self, states, h_prev, gate_sum, clip, acts, member, h_proj, r_weights, h_bias):
        hidden, shape = self.hidden, self.step_shape(self.hidden)
        if self.linear_before_reset:
            def reset_term(t, d, b, j):
                recurrent = self.at(h_proj, t, d, b, 2 * hidden + j)
                if h_bias is not None:
                    recurrent = recurrent + h_bias(d, j)
                return lambda reset: gate_sum("h", t, d, b, j, recurrent=False) + reset * recurrent
        else:  # (r * h_{t-1}) @ R_h^T needs every unit's r: a TE of its own, then a second GEMV
            f_act = lambda d: acts(d)[0]

            def reset(*idx):
                t, d, b, j = self.split(idx)
                return f_act(d)(clip(gate_sum("r", t, d, b, j))) * h_prev(t, d, b, j)
            reset_h = te.compute(shape, self.named(reset), name="reset_h", attrs=member)
            kr = te.reduce_axis((0, hidden), name="k")

            def project_reset(*idx):
                t, d, b, j = self.split(idx)
                return te.sum(self.at(reset_h, t, d, b, kr) * r_weights(d, kr, 2 * hidden + j), axis=kr)
            reset_proj = te.compute(shape, self.named(project_reset), name="reset_proj", attrs=member)

            def reset_term(t, d, b, j):
                return lambda _: gate_sum("h", t, d, b, j, recurrent=False) + self.at(reset_proj, t, d, b, j)

        def hidden_state(*idx):
            t, d, b, j = self.split(idx)
            new = cells.gru_cell(lambda name: gate_sum(name, t, d, b, j), h_prev(t, d, b, j),
                                 reset_term(t, d, b, j), acts(d), clip)
            return self.masked(t, b, new, h_prev(t, d, b, j))
        h = te.compute(shape, self.named(hidden_state), name="h", attrs={**member, STATE: states["h"]})
        return [self.sequence_output(h), self.last(h, "y_h")]

    def _rnn(self, states, h_prev, gate_sum, clip, acts, member):
        def hidden_state(*idx):
            t, d, b, j = self.split(idx)
            return self.masked(t, b, cells.rnn_cell(lambda name: gate_sum(name, t, d, b, j), acts(d), clip),
                               h_prev(t, d, b, j))
        h = te.compute(self.step_shape(self.hidden), self.named(hidden_state), name="h",
                       attrs={**member, STATE: states["h"]})
        return [self.sequence_output(h), self.last(h, "y_h")]

    # --- outputs ---------------------------------------------------------------------------------------
    def sequence_output(self, h):
        """Y [T, D, B, H] (layout 1: [B, T, D, H]) in input time order: zeros after a row's length."""
        dirs = len(self.directions)

        def read(time, d, b, j):
            step = self.time_of(time, d, b)  # the position <-> step map is its own inverse
            value = self.at(h, step, d, b, j)
            return self.masked(time, b, value, tirx.const(0.0, self.dtype))
        if self.layout == 0:
            return te.compute((self.steps, dirs, self.batch, self.hidden), read, name="y")
        return te.compute((self.batch, self.steps, dirs, self.hidden), lambda b, t, d, j: read(t, d, b, j), name="y")

    def last(self, state, name):
        """Y_h / Y_c [D, B, H] (layout 1: [B, D, H]): the state after the last step (padding keeps it); zeros
        for a row of length 0, as ONNX Runtime gives (the specification does not say)."""
        dirs, last = len(self.directions), self.steps - 1

        def read(d, b, j):
            value = self.at(state, last, d, b, j)
            if self.lens is None:
                return value
            return tirx.if_then_else(self.length(b) > 0, value, tirx.const(0.0, self.dtype))
        if self.layout == 0:
            return te.compute((dirs, self.batch, self.hidden), read, name=name)
        return te.compute((self.batch, dirs, self.hidden), lambda b, d, j: read(d, b, j), name=name)
