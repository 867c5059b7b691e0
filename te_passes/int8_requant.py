"""Requantization fused into the integer kernels' write-back: a QuantizeLinear TE reading an integer GEMM's
or convolution's scaled sum (int8_gemm.py, int8_conv.py; marked SCALED), directly or through the add of a
dequantized int32 bias whose scale is the sum's (sa * sw[j], as ONNX Runtime's quantizer makes biases),
becomes

    q = saturate(nearbyint(float32(acc + corr[j] [- zw[j] rowsum] + bias[j]) * (sa * sw[j] / sy)) + zy)

read straight off the int32 accumulator: int8 in, int8 out, the float32 value between them gone, and the
requantization rounded once, with ONNX Runtime's multiplier (te_passes/quant.py), so the result is its
QLinearConv / QLinearMatMul's bit for bit.
"""

from __future__ import annotations

import numpy as np
from tvm import te, tirx

from souffle_py.ir.exprs import substitute
from te_passes.int8_gemm import SCALED
from te_passes.int8_reads import add_param, constant, is_load
from te_passes.quant import DEQUANTIZE_TAG, QUANTIZE_TAG, is_rounding, requantize_expr


def quantize_of_map(program, op):
    """(the read of x, y_scale, y_zero_point, dtype) where `op` is a per-tensor QuantizeLinear TE of one
    map read point for point, else None."""
    if not isinstance(op, te.ComputeOp) or QUANTIZE_TAG not in (op.attrs or {}) or op.reduce_axis:
        return None
    found = _quantize_parts(program, op)
    return found if found is not None and _identity(found[0], [iv.var for iv in op.axis]) else None


def fused_requantize(program, op, params, param_tensors) -> te.ComputeOp | None:
    """The requantizing TE replacing the QuantizeLinear TE `op`, or None where the pattern does not hold."""
    found = quantize_of_map(program, op)
    if found is None:
        return None
    x_load, y_scale, y_zero, dtype = found
    scaled, bias = x_load.args[0].op, None
    if SCALED not in (scaled.attrs or {}):
        split = _bias_add(program, scaled)
        if split is None:
            return None
        scaled, bias = split
    channel = int(scaled.attrs[SCALED])
    try:  # the scaled sum: float32(total) * scale[channel], total the compensated int32 sum
        total, scale_load = scaled.body[0].a.value, scaled.body[0].b
    except AttributeError:
        return None
    if not is_load(scale_load) or scale_load.args[0].op.name not in params:
        return None
    scales = np.asarray(params[scale_load.args[0].op.name], np.float32)
    offsets = np.zeros(scales.shape, np.int64)
    if bias is not None:
        bias_q, bias_scale = bias
        # the quantizer's bias scale is sa * sw[j], possibly rounded otherwise in its last bit; ONNX Runtime's
        # fused kernels add the int32 bias as it is, so does this. A zero bias is zero at any scale (timm's
        # RexNet: every conv's bias 0, dequantized at scales unrelated to sa * sw[j]; left unfused, its
        # float32 path flipped values lying at half steps)
        if bias_q.size != scales.size:
            return None
        agree = np.isclose(np.broadcast_to(bias_scale, scales.shape), scales, rtol=1e-6, atol=0.0)
        if np.any(~agree & (bias_q.reshape(scales.shape) != 0)):
            return None
        offsets = bias_q.astype(np.int64)
    mult = (scales / np.float32(y_scale)).astype(np.float32)
    offsets_t = add_param(params, param_tensors, offsets.astype(np.int32), f"{op.name}_bias")
    mult_t = add_param(params, param_tensors, mult, f"{op.name}_multipliers")
    zero = tirx.const(y_zero, "int32")
    scaled_axes = [iv.var for iv in scaled.axis]

    def requantized(*i):
        value = substitute(total, {v.__chandle__(): x for v, x in zip(scaled_axes, i)})
        return requantize_expr(value + offsets_t(i[channel]), mult_t(i[channel]), zero, dtype)

    return te.compute([int(d) for d in op.output(0).shape], requantized, name=op.name,
                      attrs={QUANTIZE_TAG: dtype}).op


def _quantize_parts(program, op):
    """(the read of x, y_scale, y_zero_point, dtype) of frontend/ops/quantize.py's per-tensor quantize."""
    dtype = str(op.output(0).dtype)
    expr = op.body[0]
    while isinstance(expr, (tirx.Cast, tirx.Max, tirx.Min)):
        expr = expr.value if isinstance(expr, tirx.Cast) else expr.a
    zero = 0
    if isinstance(expr, tirx.Add):
        zero_value = constant(program, expr.b)
        if zero_value is None or zero_value.size != 1:
            return None
        zero, expr = int(zero_value[0]), expr.a
    if not is_rounding(expr):
        return None
    division = expr.args[0]
    if not isinstance(division, tirx.Div) or not is_load(division.a) or not isinstance(division.b, tirx.FloatImm):
        return None
    return division.a, float(division.b.value), zero, dtype


def _bias_add(program, op):
    """(the SCALED TE, (int32 bias, its scales)) where `op` is scaled + dequantize(int32 bias)[channel]."""
    if not isinstance(op, te.ComputeOp) or op.reduce_axis or not isinstance(op.body[0], tirx.Add):
        return None
    axes = [iv.var for iv in op.axis]
    loads = [op.body[0].a, op.body[0].b]
    if not all(is_load(x) for x in loads):
        return None
    scaled_load = next((x for x in loads if SCALED in (x.args[0].op.attrs or {})), None)
    if scaled_load is None or not _identity(scaled_load, axes):
        return None
    bias_load = loads[1] if scaled_load is loads[0] else loads[0]
    bias_op = bias_load.args[0].op
    channel = int(scaled_load.args[0].op.attrs[SCALED])
    if DEQUANTIZE_TAG not in (bias_op.attrs or {}) or [str(i) for i in bias_load.args[1:]] != [str(axes[channel])]:
        return None
    body = bias_op.body[0]
    try:
        q_load, scale = body.a.value, constant(program, body.b)
    except AttributeError:
        return None
    if isinstance(q_load, tirx.Sub):  # a per-channel zero point, which must be 0
        zero = constant(program, q_load.b)
        if zero is None or np.any(zero != 0):
            return None
        q_load = q_load.a
    if isinstance(q_load, tirx.Cast):
        q_load = q_load.value
    if not is_load(q_load) or q_load.args[0].op.name not in program.params or scale is None:
        return None
    q = np.asarray(program.params[q_load.args[0].op.name])
    if str(q.dtype) != "int32" or q.ndim != 1:
        return None
    return scaled_load.args[0].op, (q, np.asarray(scale, np.float32))


def _identity(load, axes) -> bool:
    indices = list(load.args[1:])
    return len(indices) == len(axes) and all(isinstance(i, tirx.Var) and i.same_as(v) for i, v in zip(indices, axes))
