"""Integer quantization numerics as TE expressions, shared by the frontend's quantized operators
(frontend/ops/quantize.py) and the pass that turns dequantize -> GEMM/conv -> quantize chains into integer
kernels (te_passes/int8_gemm.py), so that both compute bit for bit the same thing.

The numerics are ONNX's and ONNX Runtime's (MlasQuantizeLinear, MlasRequantizeOutput):
- quantize:    q = clamp(nearbyint(x / scale) + zp, qmin, qmax)  (round half to even, saturate)
- dequantize:  x = float32(int32(q) - zp) * scale
- requantize:  q = clamp(nearbyint(float32(acc) * multiplier) + zp, qmin, qmax), the multiplier
  a_scale * b_scale / y_scale computed once in float32 in that order, as ONNX Runtime computes it.
Products of 8-bit values are summed in int32 (exact: a K of up to 2^16 cannot overflow 255 * 128 * K).
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import tirx

QUANT_DTYPES = ("int8", "uint8")
ACC = "int32"
QUANTIZE_TAG = "souffle_quantize"      # TE attribute of a quantize TE: the output dtype
DEQUANTIZE_TAG = "souffle_dequantize"  # TE attribute of a dequantize TE (te_passes/int8_gemm.py reads them)


def qrange(dtype: str) -> tuple[int, int]:
    info = np.iinfo(dtype)
    return int(info.min), int(info.max)


def saturate_round(value, zero_point, dtype: str):
    """float32 `value` rounded half to even, shifted by the (int32 or immediate) zero point and saturated
    to `dtype`'s range, as `dtype`. Rounding after the shift is the same (the zero point is an integer).
    The lower bound first: TVM lowers a float max(a, b) to `a > b ? a : b`, so NaN saturates to the lowest
    value, as ONNX Runtime's MLAS does (its maxps returns the bound for NaN); min first, NaN became the
    highest."""
    lo, hi = qrange(dtype)
    shifted = tirx.nearbyint(value) + zero_point.astype("float32")
    clamped = tirx.min(tirx.max(shifted, tirx.const(float(lo), "float32")), tirx.const(float(hi), "float32"))
    return clamped.astype(dtype)


def is_rounding(expr) -> bool:
    """Whether `expr` is the nearbyint that `saturate_round` rounds with."""
    return isinstance(expr, tvm.ir.Call) and getattr(expr.op, "name", "").endswith("nearbyint")


def quantize_expr(x, scale, zero_point, dtype: str):
    """ONNX QuantizeLinear of one float32 value: x / scale (a true division, as ONNX Runtime divides)."""
    return saturate_round(x / scale, zero_point, dtype)


def dequantize_expr(q, scale, zero_point):
    """ONNX DequantizeLinear of one 8/32-bit value (exact up to the one float32 multiply)."""
    return (q.astype(ACC) - zero_point.astype(ACC)).astype("float32") * scale


def requantize_expr(acc, multiplier, zero_point, dtype: str):
    """An int32 accumulator scaled by a float32 multiplier into `dtype` (MlasRequantizeOutput)."""
    return saturate_round(acc.astype("float32") * multiplier, zero_point, dtype)


def multiplier(a_scale, b_scale, y_scale) -> np.ndarray:
    """a_scale * b_scale / y_scale in float32, in ONNX Runtime's order (per-channel b_scale broadcasts)."""
    a, b, y = (np.asarray(v, dtype=np.float32) for v in (a_scale, b_scale, y_scale))
    return (a * b / y).astype(np.float32)
