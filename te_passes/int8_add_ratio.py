"""The quantization of a sum of dequantized values in scale ratios, as ONNX Runtime's QLinearAdd computes it:

    round((a * sa + b * sb) / sc)  ->  round(a * (sa / sc) + b * (sb / sc))

with an 8-bit map's zero point (a = float32(q - z)) added once as the constant -z * sa / sc instead of to
every value: a * ra + (b * rb + c), two FMAs after the conversions.

(a relu between the sum and the quantization kept: max(x, 0) / sc = max(x / sc, 0) for sc > 0, NaN too).
Why: a QDQ residual add (DequantizeLinear x 2 -> Add [-> Relu] -> QuantizeLinear, composed by the vertical
pass into the last conv's write-back) divided every value, and vdivps is three of the ~24 vector operations
the write-back spends per 16 values, with the divider busy 10-16 cycles per 512-bit vector: ResNet-50's
16 residual write-backs. Not exact: ONNX Runtime does not compute the reference's division here either (its
QDQ transformer makes the pattern a QLinearAdd, with precomputed scale ratios, or fixed-point multipliers
in its AVX2 kernel), so a value may land in the neighbouring step either way (tests/test_int8.py).
A QuantizeLinear of anything else keeps its division (bit for bit ONNX Runtime's MlasQuantizeLinear).
"""

from __future__ import annotations

import numpy as np
import tvm
import tvm_ffi
from tvm import tirx

from souffle_py.ir.graph import sweep_bodies
from souffle_py.ir.program import TEProgram
from te_passes.int8_reads import dtype as dtype_of
from te_passes.quant import is_rounding

NEARBYINT = tvm.ir.Op.get("tirx.nearbyint")  # a quantization's rounding, as the frontend writes it


def quantize_sums_in_ratios(program: TEProgram) -> TEProgram:
    """`program` with each quantization of a sum of two dequantized values in ratio form (module docstring)."""
    new_of, replaced = sweep_bodies(program.stages, in_ratios)
    return program.rebuilt(new_of, program.params, program.param_tensors) if replaced else program


def in_ratios(expr):
    """`expr` with each round((a * sa + b * sb) / sc) as round(a * (sa / sc) + b * (sb / sc))."""
    return tvm_ffi.structural_map(expr, [(tvm.ir.Call, _ratio_rounding)])


def _ratio_rounding(call):
    if not call.op.same_as(NEARBYINT) or len(call.args) != 1:
        return call
    quotient = call.args[0]
    if not (isinstance(quotient, tirx.Div) and _positive_constant(quotient.b) and dtype_of(quotient) == "float32"):
        return call
    ratio = _in_ratios(quotient.a, np.float32(quotient.b.value))
    if ratio is None:
        return call
    return tirx.nearbyint(ratio)


def _in_ratios(numerator, divisor: np.float32):
    """numerator / divisor in ratio form, or None where the numerator is not a sum of two constant-scaled
    terms (or a relu of one)."""
    if isinstance(numerator, tirx.Max) and _is_zero(numerator.b):
        inner = _in_ratios(numerator.a, divisor)
        return None if inner is None else tirx.max(inner, numerator.b)
    if not isinstance(numerator, tirx.Add):
        return None
    terms = [_scaled(t) for t in (numerator.a, numerator.b)]
    if any(t is None for t in terms):
        return None
    (a, sa), (b, sb) = terms
    (a, a_offset), (b, b_offset) = _offset(a), _offset(b)
    ra, rb = _ratio(sa, divisor), _ratio(sb, divisor)
    offset = float(np.float32(a_offset) * np.float32(ra.value) + np.float32(b_offset) * np.float32(rb.value))
    if offset == 0.0:
        return a * ra + b * rb
    return a * ra + (b * rb + tirx.const(offset, "float32"))  # two FMAs


def _scaled(term):
    """(x, s) where `term` is x * s (either order) with s a float32 constant and x a dequantized value (an
    integer converted, or a folded requantization: te_passes/int8_fold.py), else None."""
    if not isinstance(term, tirx.Mul):
        return None
    for value, scale in ((term.a, term.b), (term.b, term.a)):
        if isinstance(scale, tirx.FloatImm) and _integer_valued(value):
            return value, np.float32(scale.value)
    return None


def _offset(value):
    """(float32(q), z) where `value` is float32(q + z) for an integer constant z (a zero point: the sum then
    adds z times its ratio once, not z to every value), else (value, 0)."""
    if isinstance(value, tirx.Cast) and isinstance(value.value, (tirx.Add, tirx.Sub)) \
            and isinstance(value.value.b, tirx.IntImm):
        sign = 1 if isinstance(value.value, tirx.Add) else -1
        return value.value.a.astype("float32"), sign * int(value.value.b.value)
    return value, 0


def _integer_valued(expr) -> bool:
    """Whether `expr` is an integer's float32 value: a conversion from an integer type, or a clamped
    rounding (what the fold leaves of a requantization read back)."""
    if isinstance(expr, tirx.Cast):
        return dtype_of(expr.value).startswith(("int", "uint"))
    while isinstance(expr, (tirx.Min, tirx.Max)) and isinstance(expr.b, tirx.FloatImm):
        expr = expr.a
    return is_rounding(expr)


def _ratio(scale: np.float32, divisor: np.float32):
    """scale / divisor in float32, as ONNX Runtime computes its QLinearAdd's ScaleRatio_AC."""
    return tirx.const(float(np.float32(scale) / np.float32(divisor)), "float32")


def _positive_constant(expr) -> bool:
    return isinstance(expr, tirx.FloatImm) and np.isfinite(expr.value) and expr.value > 0


def _is_zero(expr) -> bool:
    return isinstance(expr, tirx.FloatImm) and float(expr.value) == 0.0
