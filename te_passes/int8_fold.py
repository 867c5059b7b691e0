"""A value quantized and dequantized again inside one TE, folded to the float value it stands for (exact):

    float32(int32(int8(clamp(r + z, lo, hi))) - z)  =  clamp(r, lo - z, hi - z)

for r a rounded float (nearbyint's result, an integer or an infinity) and z the integer zero point: the
clamped sum is an integer-valued float of at most 8 bits, so every conversion between is exact, and
subtracting z commutes with the clamp (with NaN too: both sides clamp it to the same bound). The
vertical pass composes such pairs: a conv's requantization read by a residual add's DequantizeLinear (QDQ
ResNets), whose write-back then converted each vector float -> int32 and back around two integer adds.
"""

from __future__ import annotations

import tvm_ffi
from tvm import tirx

from souffle_py.ir.graph import sweep_bodies
from souffle_py.ir.program import TEProgram
from te_passes.int8_reads import dtype as dtype_of
from te_passes.quant import is_rounding, qrange


def fold_requantize_dequantize(program: TEProgram) -> TEProgram:
    """`program` with every quantize-dequantize pair inside a TE's body folded (module docstring)."""
    new_of, replaced = sweep_bodies(program.stages, folded)
    return program.rebuilt(new_of, program.params, program.param_tensors) if replaced else program


def folded(expr):
    """`expr` with each float32(int32(q8(clamp(r + z))) - z) replaced by clamp(r, lo - z, hi - z)."""
    return tvm_ffi.structural_map(expr, [(tirx.Cast, _fold_cast)])


def _fold_cast(cast):
    found = _pair(cast)
    if found is None:
        return cast
    rounded, zero, dtype, lower_first = found
    lo, hi = qrange(dtype)
    low, high = tirx.const(float(lo - zero), "float32"), tirx.const(float(hi - zero), "float32")
    if lower_first:  # in the clamp's own order, so that NaN saturates to the same bound (te_passes/quant.py)
        return tirx.min(tirx.max(rounded, low), high)
    return tirx.max(tirx.min(rounded, high), low)


def _pair(cast):
    """(r, z, the 8-bit type, whether the clamp bounds below first) where `cast` is
    float32(int32(q8(clamp(r + z))) - z), else None."""
    if dtype_of(cast) != "float32":
        return None
    value, zero = cast.value, 0
    if isinstance(value, tirx.Sub) and isinstance(value.b, tirx.IntImm):
        value, zero = value.a, int(value.b.value)
    elif isinstance(value, tirx.Add) and isinstance(value.b, tirx.IntImm):  # z < 0 simplified to + (-z)
        value, zero = value.a, -int(value.b.value)
    if not (isinstance(value, tirx.Cast) and dtype_of(value) == "int32" and isinstance(value.value, tirx.Cast)):
        return None
    narrow = value.value
    dtype = dtype_of(narrow)
    if dtype not in ("int8", "uint8"):
        return None
    lo, hi = qrange(dtype)
    clamped = narrow.value
    if (isinstance(clamped, tirx.Min) and _is_const(clamped.b, hi) and isinstance(clamped.a, tirx.Max)
            and _is_const(clamped.a.b, lo)):
        lower_first = True
    elif (isinstance(clamped, tirx.Max) and _is_const(clamped.b, lo) and isinstance(clamped.a, tirx.Min)
            and _is_const(clamped.a.b, hi)):
        lower_first = False
    else:
        return None
    shifted = clamped.a.a
    if zero == 0 and is_rounding(shifted):
        return shifted, 0, dtype, lower_first
    if isinstance(shifted, tirx.Add) and _is_const(shifted.b, zero) and is_rounding(shifted.a):
        return shifted.a, zero, dtype, lower_first
    return None


def _is_const(expr, value: int) -> bool:
    return isinstance(expr, (tirx.FloatImm, tirx.IntImm)) and float(expr.value) == float(value)
