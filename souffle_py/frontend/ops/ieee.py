"""Max, min and clamps that keep NaN, as ONNX Runtime's Relu, Clip, Max and Min do.

TVM lowers `tirx.max(a, b)` to `a > b ? a : b` on LLVM (x86's maxps: b whenever either is NaN) and to
fmaxf on CUDA (the number whenever one is NaN), so `max(x, 0)` turns NaN into 0: a corrupted input
becomes a plausible answer. These forms are written as selects whose result is NaN wherever an operand is
NaN, on every target; each is as cheap as the max it replaces on x86 (`x < 0 ? 0 : x` is one maxps with
its operands swapped).

Reductions (ReduceMax/Min, MaxPool, GlobalMaxPool, ArgMax/Min) propagate NaN as IEEE 754-2019's maximum
and numpy's max do. ONNX Runtime's result there depends on where the NaN sits (its vectorized loops keep
or drop it by position; docs/frontend.md has the table), so it is no reference for NaN in those.
"""

from __future__ import annotations

import numpy as np
import tvm_ffi
from tvm import te, tirx

from souffle_py.frontend.ops.util import dtype_of


def _is_float(x) -> bool:
    return dtype_of(x).startswith(("float", "bfloat"))


def maximum(a, b):
    """max(a, b), NaN where either is NaN (floats; integers: plain max)."""
    if not _is_float(a):
        return tirx.max(a, b)
    return tirx.Select(tirx.Or(tirx.isnan(a), a > b), a, b)


def minimum(a, b):
    """min(a, b), NaN where either is NaN (floats; integers: plain min)."""
    if not _is_float(a):
        return tirx.min(a, b)
    return tirx.Select(tirx.Or(tirx.isnan(a), a < b), a, b)


def at_least(x, bound):
    """x raised to `bound` (a number, never NaN): NaN stays NaN. Relu is at_least(x, 0)."""
    if not _is_float(x):
        return tirx.max(x, bound)
    return tirx.Select(x < bound, bound, x)


def at_most(x, bound):
    """x lowered to `bound` (a number, never NaN): NaN stays NaN."""
    if not _is_float(x):
        return tirx.min(x, bound)
    return tirx.Select(x > bound, bound, x)


def relu(x):
    return at_least(x, tirx.const(0, dtype_of(x)))


def _reducer(combine, identity: float, name: str):
    return te.comm_reducer(lambda a, b: combine(a, b), lambda t: tirx.const(identity, t), name=name)


# float reducers, from -inf / +inf as ONNX reduces (a row of -inf has max -inf; te.max would start from
# the lowest finite value, and so do topi's pools: a window of -inf then pooled to -3.4e38)
MAXIMUM = _reducer(maximum, -np.inf, "maximum")
MINIMUM = _reducer(minimum, np.inf, "minimum")


def with_maximum(pool: te.Tensor) -> te.Tensor:
    """A max reduction (topi's pools) rebuilt with the NaN-propagating reducer."""
    op = pool.op
    reduce = op.body[0]
    body = MAXIMUM(reduce.source[0], axis=list(op.reduce_axis), where=reduce.condition)
    return te.ComputeOp(op.name, op.tag, op.attrs, op.axis, op.reduce_axis, [body]).output(0)


def _register_reducers() -> None:
    """Make TIR schedules recognize these reducers, as they do max and min: rfactor (vector lanes of
    partial results), cross-thread reductions and MetaSchedule need the reducer in TVM's registry.

    TVM calls every registered getter on every reduction it matches, of any dtype, and a Python exception
    inside one corrupts its heap: the getters never raise. For floats the identity getter answers with the
    init when it is the reducer's identity (-inf, +inf); for anything else it answers with a
    fresh variable, which matches no init (integer max and min are TVM's own). The callbacks are kept in
    TVM's global function table, which lives as long as the process (the registry's own references are
    released after the interpreter at exit, which a Python callback would not survive)."""
    register = tvm_ffi.get_global_func("s_tir.schedule.RegisterReducer", allow_missing=True)
    if register is None:
        return
    for name, combine, extreme in (("maximum", maximum, -np.inf), ("minimum", minimum, np.inf)):
        def combiner(x, y, combine=combine):
            try:
                return [combine(x[0], y[0]) if str(x[0].ty).startswith("float") else x[0]]
            except Exception:  # noqa: BLE001  (never raise into TVM: see above)
                return [x[0]]

        def identity(values, extreme=extreme):
            value = values[0]
            try:
                dtype = str(value.ty)
                if dtype.startswith("float") and isinstance(value, tirx.FloatImm) and value.value == extreme:
                    return [value]
                return [tirx.Var("no_identity", dtype)]
            except Exception:  # noqa: BLE001
                return [tirx.Var("no_identity", "float32")]

        key = f"souffle.ieee.{name}"
        tvm_ffi.register_global_func(f"{key}.combiner", combiner, override=True)
        tvm_ffi.register_global_func(f"{key}.identity", identity, override=True)
        register(1, tvm_ffi.get_global_func(f"{key}.combiner"), tvm_ffi.get_global_func(f"{key}.identity"))


_register_reducers()


def keep_nan(x, value):
    """`value` where x is a number, x (NaN) where x is NaN: a result that x's NaN must reach (Sign).
    Spelled as a select: TVM's simplifier folds x * 0 to 0 for floats too."""
    return tirx.Select(tirx.isnan(x), x, value) if _is_float(x) else value


def equal_or_both_nan(x, y):
    """x == y, or both NaN: where a NaN-propagating extreme sits in its row (ArgMax, Hardmax)."""
    if not _is_float(x):
        return x == y
    return tirx.Or(x == y, tirx.And(tirx.isnan(x), tirx.isnan(y)))


def nonzero(x):
    """x != 0 as a bool, NaN counting as nonzero (float to bool casts; TVM's != on floats is ordered)."""
    zero = tirx.const(0, dtype_of(x))
    if not _is_float(x):
        return x != zero
    return tirx.Or(x != zero, tirx.isnan(x))
