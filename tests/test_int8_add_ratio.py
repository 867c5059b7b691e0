"""The residual add's quantization in scale ratios (te_passes/int8_add_ratio.py): the rewritten expression,
values within one step of the division's (ONNX Runtime's QLinearAdd is not the division either: the QDQ
residual nets of tests/test_int8.py are asserted within one step of it), and what is left alone."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import te, tirx

from te_passes.int8_add_ratio import in_ratios
from te_passes.int8_fold import folded
from te_passes.quant import dequantize_expr, quantize_expr, requantize_expr

SA, SB, SC = 0.016270129, 0.026538674, 0.029733557  # ResNet-50's first residual add


def _residual(acc, res, relu: bool):
    """A conv's requantization dequantized (folded) plus a dequantized int8 map, quantized: the residual add
    as the vertical pass composes it into the conv's write-back."""
    conv = dequantize_expr(requantize_expr(acc, tirx.const(0.01, "float32"), tirx.const(-2, "int32"), "int8"),
                           tirx.const(SA, "float32"), tirx.const(-2, "int32"))
    total = folded(conv) + dequantize_expr(res, tirx.const(SB, "float32"), tirx.const(-128, "int32"))
    if relu:
        total = tirx.max(total, tirx.const(0.0, "float32"))
    return quantize_expr(total, tirx.const(SC, "float32"), tirx.const(-128, "int32"), "int8")


def _run(tensor, inputs, values):
    lib = tvm.compile(te.create_prim_func([*inputs, tensor]), target="llvm")
    out = tvm.runtime.empty((256,), "int8")
    lib(*(tvm.runtime.tensor(v) for v in values), out)
    return out.numpy()


@pytest.mark.parametrize("relu", [False, True])
def test_the_sum_is_scaled_by_ratios_within_one_step(relu):
    acc = te.placeholder((256,), "int32", name="acc")
    res = te.placeholder((256,), "int8", name="res")
    plain = te.compute((256,), lambda i: _residual(acc[i], res[i], relu), name="plain")
    ratio = te.compute((256,), lambda i: in_ratios(_residual(acc[i], res[i], relu)), name="ratio")
    before, after = str(plain.op.body[0]), str(ratio.op.body[0])
    assert " / " in before and " / " not in after
    assert "- -128" in before and "- -128" not in after  # the residual's zero point: one constant, not per value
    assert repr(float(np.float32(SA) / np.float32(SC)))[:8] in after
    assert ("nearbyint(T.max(" in after) == relu  # the relu kept around the scaled sum

    rng = np.random.default_rng(0)
    values = (rng.integers(-20000, 20000, 256).astype(np.int32), rng.integers(-128, 128, 256).astype(np.int8))
    a, b = _run(plain, (acc, res), values), _run(ratio, (acc, res), values)
    assert np.max(np.abs(a.astype(int) - b.astype(int))) <= 1


def test_other_quantizations_keep_their_division():
    x = te.placeholder((4,), "float32", name="x")
    scale, zero = tirx.const(0.5, "float32"), tirx.const(0, "int32")
    floats = quantize_expr(x[0] * 0.5 + x[1] * 0.25, scale, zero, "int8")  # a float model's sum, not dequantized
    assert in_ratios(floats).same_as(floats)
    one = quantize_expr(dequantize_expr(x[0].astype("int8"), tirx.const(0.1, "float32"), zero), scale, zero, "int8")
    assert in_ratios(one).same_as(one)  # a single dequantized value: QuantizeLinear bit for bit
