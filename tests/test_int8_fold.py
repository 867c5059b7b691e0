"""The quantize-dequantize fold (te_passes/int8_fold.py): the rewritten expression, and its values equal to
the unfolded one's bit for bit, infinities and NaN included, for int8 and uint8 zero points."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import te, tirx

from te_passes.int8_fold import folded
from te_passes.quant import dequantize_expr, quantize_expr


def _pair(x, scale: float, zero: int, dtype: str):
    """DequantizeLinear(QuantizeLinear(x)), as the frontend writes them and the vertical pass composes them."""
    q = quantize_expr(x, tirx.const(scale, "float32"), tirx.const(zero, "int32"), dtype)
    return dequantize_expr(q, tirx.const(0.5, "float32"), tirx.const(zero, "int32"))


@pytest.mark.parametrize("zero,dtype", [(0, "int8"), (5, "int8"), (-128, "int8"), (0, "uint8"), (128, "uint8")])
def test_the_pair_folds_to_a_clamp_with_the_same_values(zero, dtype):
    x = te.placeholder((64,), "float32", name="x")
    plain = te.compute((64,), lambda i: _pair(x[i], 0.25, zero, dtype), name="plain")
    fold = te.compute((64,), lambda i: folded(_pair(x[i], 0.25, zero, dtype)), name="fold")
    text = str(fold.op.body[0])
    assert "int8" not in text and "int32" not in text  # no conversion left
    assert "int8" in str(plain.op.body[0]) or "uint8" in str(plain.op.body[0])

    values = np.concatenate([np.linspace(-300, 300, 57, dtype=np.float32),
                             np.array([np.inf, -np.inf, np.nan, 0.125, -0.125, 31.875, -32.125], np.float32)])
    out = {}
    for name, tensor in (("plain", plain), ("fold", fold)):
        lib = tvm.compile(te.create_prim_func([x, tensor]), target="llvm")
        buf = tvm.runtime.empty((64,), "float32")
        lib(tvm.runtime.tensor(values), buf)
        out[name] = buf.numpy()
    # NaN too: the unfolded max(NaN + z, lo) is lo, as the fold's max(NaN, lo - z) is lo - z
    np.testing.assert_array_equal(out["fold"], out["plain"])


def test_another_conversion_is_left_alone():
    x = te.placeholder((4,), "float32", name="x")
    body = (x[0].astype("int32") - 3).astype("float32")  # no clamp, no rounding: not a quantized value
    assert folded(body).same_as(body)
