"""The gate equations of ONNX's three recurrent cells (LSTM, GRU, RNN) and their activation functions.

A cell is only its equations: given each gate's pre-activation (input projection + recurrent projection +
bias, rnn.py builds those the same way for every cell) and the previous state, it says what the next state
is. Everything else -- directions, layouts, sequence lengths, initial states, the state placeholders the
recurrence machinery closes (souffle_py/ir/marks.py) -- is shared, in rnn.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from tvm import tirx

from souffle_py.frontend.ops.ieee import relu


def _const(value, like):
    """`value` in the element type of the expression `like` (a call has a type, not a dtype)."""
    dtype = like.dtype if hasattr(like, "dtype") else like.ty.dtype
    return tirx.const(value, str(dtype))


# name -> (function(x, alpha, beta), default alpha, default beta, uses alpha, uses beta), as the ONNX
# specification defines them (and ONNX Runtime, which consumes alpha/beta only for functions that take them).
ACTIVATIONS: dict[str, tuple[Callable, float, float, bool, bool]] = {
    "relu": (lambda x, a, b: relu(x), 0.0, 0.0, False, False),
    "tanh": (lambda x, a, b: tirx.tanh(x), 0.0, 0.0, False, False),
    "sigmoid": (lambda x, a, b: tirx.sigmoid(x), 0.0, 0.0, False, False),
    "affine": (lambda x, a, b: _const(a, x) * x + _const(b, x), 1.0, 0.0, True, True),
    "leakyrelu": (lambda x, a, b: tirx.if_then_else(x >= _const(0.0, x), x, _const(a, x) * x), 0.01, 0.0, True, False),
    "thresholdedrelu": (lambda x, a, b: tirx.if_then_else(x > _const(a, x), x, _const(0.0, x)), 1.0, 0.0, True, False),
    "scaledtanh": (lambda x, a, b: _const(a, x) * tirx.tanh(_const(b, x) * x), 1.0, 1.0, True, True),
    "hardsigmoid": (lambda x, a, b: tirx.max(_const(0.0, x), tirx.min(_const(1.0, x), _const(a, x) * x + _const(b, x))),
                    0.2, 0.5, True, True),
    "elu": (lambda x, a, b: tirx.if_then_else(x >= _const(0.0, x), x, _const(a, x) * (tirx.exp(x) - _const(1.0, x))),
            1.0, 0.0, True, False),
    "softsign": (lambda x, a, b: x / (_const(1.0, x) + tirx.abs(x)), 0.0, 0.0, False, False),
    "softplus": (lambda x, a, b: tirx.log(_const(1.0, x) + tirx.exp(x)), 0.0, 0.0, False, False),
}


@dataclass(frozen=True)
class Activation:
    name: str
    alpha: float
    beta: float

    def __call__(self, x):
        return ACTIVATIONS[self.name][0](x, self.alpha, self.beta)


def activations(names, alphas, betas, unknown: Callable[[str], Exception]) -> list[Activation]:
    """The activation list with each function's alpha/beta: the attribute lists are consumed in order by
    the functions that take them; a function without a value left gets its ONNX default."""
    alphas, betas, found = list(alphas or []), list(betas or []), []
    for name in names:
        key = name.decode() if isinstance(name, bytes) else str(name)
        entry = ACTIVATIONS.get(key.lower())
        if entry is None:
            raise unknown(key)
        _, alpha, beta, uses_alpha, uses_beta = entry
        if uses_alpha and alphas:
            alpha = float(alphas.pop(0))
        if uses_beta and betas:
            beta = float(betas.pop(0))
        found.append(Activation(key.lower(), alpha, beta))
    return found


@dataclass(frozen=True)
class Cell:
    """One recurrent cell type: its gate blocks in ONNX's W/R/B order, its states and default activations."""

    op_type: str
    gates: tuple[str, ...]
    states: tuple[str, ...]
    default_activations: tuple[str, ...]

    @property
    def num_gates(self) -> int:
        return len(self.gates)


LSTM = Cell("LSTM", ("i", "o", "f", "c"), ("h", "c"), ("Sigmoid", "Tanh", "Tanh"))
GRU = Cell("GRU", ("z", "r", "h"), ("h",), ("Sigmoid", "Tanh"))
RNN = Cell("RNN", ("i",), ("h",), ("Tanh",))
CELLS = {cell.op_type: cell for cell in (LSTM, GRU, RNN)}


def lstm_cell(pre, c_prev, peephole, act, clip, input_forget):
    """(c, h-from-c) of the LSTM: pre(gate) is a gate's pre-activation, peephole(gate) its P term's weight
    or None. c_t = f * c_{t-1} + i * g(pre_c); h_t = o * h(c_t), o seeing c_t through its peephole."""
    f_act, g_act, h_act = act

    def gate(name, cell_value):
        value = pre(name)
        weight = peephole(name)
        if weight is not None:
            value = value + weight * cell_value
        return f_act(clip(value))

    i = gate("i", c_prev)
    f = _const(1.0, i) - i if input_forget else gate("f", c_prev)
    c = f * c_prev + i * g_act(clip(pre("c")))
    return c, lambda c_now: gate("o", c_now) * h_act(c_now)


def gru_cell(pre, h_prev, reset_term, act, clip):
    """h_t = (1 - z) * g(pre_h with r applied) + z * h_{t-1}; reset_term(r) is pre_h given r (before or after
    the recurrent projection, as linear_before_reset says)."""
    f_act, g_act = act
    z = f_act(clip(pre("z")))
    r = f_act(clip(pre("r")))
    n = g_act(clip(reset_term(r)))
    return (_const(1.0, z) - z) * n + z * h_prev


def rnn_cell(pre, act, clip):
    """h_t = f(x W^T + h_{t-1} R^T + b)."""
    (f_act,) = act
    return f_act(clip(pre("i")))
