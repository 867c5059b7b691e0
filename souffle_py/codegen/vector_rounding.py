"""Rounding in vector lanes on the CPU, two rewrites of a kernel's TIR before the vectorizer:

- nearbyint: TVM 0.27 registers `tirx.nearbyint` without the TVectorizable attribute that `round` and
  `floor` have, so its vectorizer scalarizes every loop that rounds (each quantization), and LLVM
  re-vectorized the scalar loop with gathers and byte-wise scatters: BERT-base's dynamic quantization of its
  128 x 3072 FFN activations took 0.18-0.35 ms. The same LLVM intrinsic TVM lowers it to (`llvm.nearbyint`,
  vrndscaleps), called as a pure LLVM intrinsic, which TVM vectorizes.
- a saturating quantization q8(clamp(nearbyint(v) + z, lo, hi)) (te_passes/quant.py) as
  q8(lrint(clamp(v, lo - z, hi - z)) + z): the same values (z, lo and hi are integers and rounding is
  monotone; NaN meets the clamp's first bound in both, in the same order), in three or four vector
  operations instead of five (vcvtps2dq rounds half to even as it converts: no vrndscaleps, and the zero
  point added to the integer, or folded by LLVM into the narrowed bytes). MLAS quantizes the same way.
  Where the value is bounded (codegen/float_bounds.py: a residual add's sum of dequantized 8-bit maps,
  never NaN), the clamp is on the integer instead, which LLVM folds into the saturating narrowing
  (vpmovsdb): two operations fewer.
GPU modules keep `nearbyint` (their codegen has no vector form of it)."""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx

from souffle_py.codegen.float_bounds import bounds

NEARBYINT = tvm.ir.Op.get("tirx.nearbyint")
INT_SAFE = 2.0 ** 30  # a bounded value within this converts to int32 and takes a zero point without overflow


def _lanes_ready(call):
    if not call.op.same_as(NEARBYINT):
        return call
    return tirx.call_llvm_pure_intrin(str(call.ty.dtype), "llvm.nearbyint", call.args[0])


def _converting_saturation(cast):
    """`cast` = q8(clamp(nearbyint(v) + z)) as q8(lrint(clamp(v, lo - z, hi - z)) + z), else unchanged."""
    dtype = str(cast.ty.dtype)
    if dtype.split("x")[0] not in ("int8", "uint8"):
        return cast
    outer = cast.value
    if not isinstance(outer, (tirx.Min, tirx.Max)) or not isinstance(outer.a, (tirx.Min, tirx.Max)) \
            or type(outer) is type(outer.a) or not all(_is_float_const(e) for e in (outer.b, outer.a.b)):
        return cast
    shifted = outer.a.a
    value, zero = _rounded_and_zero(shifted)
    if value is None:
        return cast
    inner, outer_bound = outer.a.b, outer.b
    int32 = dtype.replace("uint8", "int32").replace("int8", "int32")
    bounded = all(abs(b) < INT_SAFE for b in bounds(value))  # then the clamp is the integer narrowing's
    if not bounded:
        shift = (lambda bound: bound - zero) if zero is not None else (lambda bound: bound)
        value = type(outer)(type(outer.a)(value, shift(inner)), shift(outer_bound))
    converted = tirx.call_llvm_pure_intrin(int32, "llvm.lrint", value)
    if zero is not None:
        converted = converted + zero.astype(int32)
    if bounded:
        low, high = (tirx.const(int(b.value), int32) for b in (inner, outer_bound))
        converted = type(outer)(type(outer.a)(converted, low), high)
    return converted.astype(dtype)


def _rounded_and_zero(shifted):
    """(v, z) where `shifted` is nearbyint(v) + z with z a float32 integer (a constant, or an integer
    converted), (v, None) where it is nearbyint(v), else (None, None)."""
    if isinstance(shifted, tvm.ir.Call) and shifted.op.same_as(NEARBYINT):
        return shifted.args[0], None
    if isinstance(shifted, tirx.Add) and isinstance(shifted.a, tvm.ir.Call) and shifted.a.op.same_as(NEARBYINT):
        zero = shifted.b
        if (isinstance(zero, tirx.FloatImm) and float(zero.value).is_integer()) or (
                isinstance(zero, tirx.Cast) and str(zero.value.ty.dtype).startswith(("int", "uint"))):
            return shifted.a.args[0], zero
    return None, None


def _is_float_const(expr) -> bool:
    return isinstance(expr, tirx.FloatImm) and float(expr.value).is_integer()


def vector_rounding(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` with saturating quantizations converting as they round and every other nearbyint a pure call of
    llvm.nearbyint (module docstring)."""
    body = tvm_ffi.structural_map(func.body, [(tirx.Cast, _converting_saturation)])
    body = tvm_ffi.structural_map(body, [(tvm.ir.Call, _lanes_ready)])
    return func if body.same_as(func.body) else func.with_body(body)


@tirx.transform.prim_func_pass(opt_level=0, name="souffle.VectorRounding")
def vector_rounding_pass(func, _mod, _ctx):
    return vector_rounding(func)
