"""Interval bounds of a float32 expression from what its leaves are: 8- and 16-bit integers converted,
constants, clamps, sums and products of those. Why: a quantization whose value is bounded (a residual add's
sum of two dequantized 8-bit maps in scale ratios) converts to int32 without overflow and saturates in the
integer narrowing (vpmovsdb) instead of a float clamp (codegen/vector_rounding.py). Unbounded (±inf) is the
answer for anything else: a float load may hold NaN or inf, an int32 accumulator any value."""

from __future__ import annotations

import math

import numpy as np
import tvm
from tvm import tirx

UNBOUNDED = (-math.inf, math.inf)


def bounds(expr) -> tuple[float, float]:
    """(lo, hi) that every value of `expr` lies in (NaN never: a bounded expression has no NaN leaf)."""
    if isinstance(expr, (tirx.IntImm, tirx.FloatImm)):
        value = float(expr.value)
        return (value, value) if math.isfinite(value) else UNBOUNDED
    dtype = str(expr.ty.dtype) if hasattr(expr, "ty") else ""
    base = dtype.split("x")[0]
    if base in ("int8", "uint8", "int16", "uint16"):  # whatever it computes, its type holds it
        info = np.iinfo(base)
        return float(info.min), float(info.max)
    if isinstance(expr, tirx.Cast):
        return bounds(expr.value)
    if isinstance(expr, tirx.Broadcast):
        return bounds(expr.value)
    if isinstance(expr, (tirx.Min, tirx.Max)):
        (alo, ahi), (blo, bhi) = bounds(expr.a), bounds(expr.b)
        if not (math.isfinite(blo) and math.isfinite(bhi)):
            return UNBOUNDED  # TVM's min and max are selects that return b for a NaN: b must be NaN-free
        pick = min if isinstance(expr, tirx.Min) else max
        return pick(alo, blo), pick(ahi, bhi)
    if isinstance(expr, (tirx.Add, tirx.Sub, tirx.Mul)):
        return _arithmetic(expr, bounds(expr.a), bounds(expr.b))
    if isinstance(expr, tvm.ir.Call) and getattr(expr.op, "name", "").endswith("nearbyint"):
        lo, hi = bounds(expr.args[0])
        return math.floor(lo) if math.isfinite(lo) else lo, math.ceil(hi) if math.isfinite(hi) else hi
    return UNBOUNDED


def _arithmetic(expr, a, b) -> tuple[float, float]:
    if not all(math.isfinite(v) for v in (*a, *b)):
        return UNBOUNDED  # inf * 0 and inf - inf are NaN: no bound at all
    if isinstance(expr, tirx.Add):
        return a[0] + b[0], a[1] + b[1]
    if isinstance(expr, tirx.Sub):
        return a[0] - b[1], a[1] - b[0]
    products = [x * y for x in a for y in b]
    return min(products), max(products)
