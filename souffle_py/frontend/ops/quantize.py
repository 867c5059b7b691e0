"""Quantization operators of ONNX's QDQ and QOperator formats: QuantizeLinear, DequantizeLinear,
DynamicQuantizeLinear, QLinearMatMul, QLinearConv, MatMulInteger, ConvInteger, and ONNX Runtime's
com.microsoft QLinearAdd / QLinearMul (its quantize_static emits them for residual adds in QOperator form).

Integer products are summed in int32 and requantized with a float32 multiplier (te_passes/quant.py), as
ONNX Runtime does, so a QOperator model's int8 values match ONNX Runtime's bit for bit. Scales and zero
points are per tensor, or per axis (a 1-D constant along `axis`); block quantization (`block_size`), float8
and 4-bit types are refused by name. A DequantizeLinear of a constant is not folded (lower.NEVER_FOLD): it
stays a TE reading the int8 constant, so that te_passes/int8_gemm.py can see the integer weight.
"""

from __future__ import annotations

import numpy as np
from tvm import te, tirx

from souffle_py.frontend.context import register
from souffle_py.frontend.ops.conv import conv, conv_geometry
from souffle_py.frontend.ops.nn import matmul
from souffle_py.frontend.ops.reduce import reduce
from souffle_py.frontend.ops.util import broadcast_shape, dtype_of, onnx_dtype, read, shape_of
from te_passes.int8_gemm import INT8_GEMM
from te_passes.quant import (ACC, DEQUANTIZE_TAG, QUANT_DTYPES, QUANTIZE_TAG, dequantize_expr, multiplier,
                             quantize_expr, requantize_expr)

STORED_DTYPES = (*QUANT_DTYPES, "int16", "uint16")   # what QuantizeLinear may produce
DEQUANT_INPUTS = (*STORED_DTYPES, "int32")            # what DequantizeLinear may read (int32: biases)


class QParam:
    """A scale or zero point as a function of the output index: an immediate (per tensor), or a read of a
    1-D tensor along `axis` (per axis). `values` holds it when it is a compile-time constant."""

    def __init__(self, ctx, i: int, rank: int, axis: int, dtype: str, role: str):
        self.values = None
        if not ctx.has(i):
            self.read = lambda idx: tirx.const(0, dtype)
            self.values = np.zeros((1,), dtype)
            return
        if ctx.dtype(i) != dtype:
            raise ctx.unsupported(f"{role} of dtype {ctx.dtype(i)} is not supported (expected {dtype})")
        shape = ctx.shape(i)
        size = int(np.prod(shape, dtype=np.int64))
        if ctx.is_const(i):
            self.values = ctx.const(i)
        if size == 1:
            if self.values is not None:
                item = np.asarray(self.values).reshape(-1)[0].item()
                self.read = lambda idx: tirx.const(item, dtype)
            else:
                tensor = ctx.tensor(i)
                self.read = lambda idx: tensor(*([0] * tensor.ndim))
            return
        if len(shape) != 1:
            raise ctx.unsupported(f"{role} of shape {list(shape)}: only per-tensor and per-axis (1-D) "
                                  "quantization is supported (block quantization is not)")
        tensor = ctx.tensor(i)
        self.read = lambda idx: tensor(idx[axis])

    def __call__(self, idx):
        return self.read(idx)


def _axis(ctx, rank: int) -> int:
    """The quantization axis; ignored (0) for a per-tensor scale, as ONNX says."""
    if ctx.attr("block_size", 0):
        raise ctx.unsupported("block quantization (block_size) is not supported")
    if int(np.prod(ctx.shape(1), dtype=np.int64)) == 1:
        return 0
    return ctx.axis(ctx.attr("axis", 1), max(rank, 1))


def _check_float_scale(ctx, i: int, role: str = "scale"):
    if ctx.dtype(i) != "float32":
        raise ctx.unsupported(f"{role} of dtype {ctx.dtype(i)} is not supported (float32 only)")


@register("QuantizeLinear", attributes=["axis", "saturate", "block_size", "output_dtype", "precision"])
def lower_quantize_linear(ctx):
    x = ctx.tensor(0)
    if dtype_of(x) != "float32":
        raise ctx.unsupported(f"input dtype {dtype_of(x)} is not supported (float32 only)")
    _check_float_scale(ctx, 1)
    if ctx.attr("precision", 0):
        raise ctx.unsupported("the precision attribute is not supported")
    out_dtype = ctx.dtype(2) if ctx.has(2) else _onnx_output_dtype(ctx)
    if out_dtype not in STORED_DTYPES:
        raise ctx.unsupported(f"output type {out_dtype} is not supported ({', '.join(STORED_DTYPES)} only)")
    axis = _axis(ctx, x.ndim)
    scale = QParam(ctx, 1, x.ndim, axis, "float32", "y_scale")
    zero = QParam(ctx, 2, x.ndim, axis, out_dtype, "y_zero_point")
    return [te.compute(x.shape, lambda *i: quantize_expr(x(*i), scale(i), zero(i), out_dtype), name="quantize",
                       attrs={QUANTIZE_TAG: out_dtype})]


def _onnx_output_dtype(ctx) -> str:
    code = ctx.attr("output_dtype", 0)
    return onnx_dtype(code) if code else "uint8"


@register("DequantizeLinear", attributes=["axis", "block_size", "output_dtype"])
def lower_dequantize_linear(ctx):
    q = ctx.tensor(0)
    if dtype_of(q) not in DEQUANT_INPUTS:
        raise ctx.unsupported(f"input type {dtype_of(q)} is not supported ({', '.join(DEQUANT_INPUTS)} only)")
    _check_float_scale(ctx, 1, "x_scale")
    if ctx.attr("output_dtype", 0) not in (0, 1):  # 1: FLOAT
        raise ctx.unsupported("output types other than float32 are not supported")
    axis = _axis(ctx, q.ndim)
    scale = QParam(ctx, 1, q.ndim, axis, "float32", "x_scale")
    zero = QParam(ctx, 2, q.ndim, axis, dtype_of(q), "x_zero_point")
    return [te.compute(q.shape, lambda *i: dequantize_expr(q(*i), scale(i), zero(i)), name="dequantize",
                       attrs={DEQUANTIZE_TAG: axis})]


def _whole(x: te.Tensor, kind: str) -> te.Tensor:
    """max or min of all of x (0-d) in two steps: along the rows first (a row reduction the default rule
    runs in parallel and in vector lanes), then over the row results. One reduction over every axis has no
    spatial loop to share out: BERT-base's FFN activations took 0.9 ms each for min and max, scalar."""
    if x.ndim < 2:
        return reduce(x, list(range(x.ndim)), False, kind, f"x_{kind}")
    rows = reduce(x, [x.ndim - 1], False, kind, f"x_row_{kind}")
    return reduce(rows, list(range(rows.ndim)), False, kind, f"x_{kind}")


@register("DynamicQuantizeLinear")
def lower_dynamic_quantize_linear(ctx):
    """uint8 with scale (max(x, 0) - min(x, 0)) / 255 (1 where that is 0, as ONNX Runtime does) and the zero
    point round(-min / scale) saturated; three outputs: y, y_scale, y_zero_point (scalars)."""
    x = ctx.tensor(0)
    if dtype_of(x) != "float32":
        raise ctx.unsupported(f"input dtype {dtype_of(x)} is not supported (float32 only)")
    max_t, min_t = _whole(x, "max"), _whole(x, "min")
    hi, lo = (lambda: max_t()), (lambda: min_t())
    zero_f = tirx.const(0.0, "float32")

    def scale_of():
        top, bottom = tirx.max(hi(), zero_f), tirx.min(lo(), zero_f)
        return tirx.Select(top == bottom, tirx.const(1.0, "float32"), (top - bottom) / tirx.const(255.0, "float32"))

    def zero_of(scale):
        start = tirx.const(0.0, "float32") - tirx.min(lo(), zero_f) / scale
        clamped = tirx.max(tirx.min(start, tirx.const(255.0, "float32")), zero_f)
        return tirx.nearbyint(clamped).astype("uint8")

    # the scale and zero point computed once (0-d TEs) and read by the quantization: recomputed in it, two
    # scalar divisions and a rounding per vector of 16 took BERT-base's FFN activations 0.35 ms
    scale0 = te.compute((), scale_of, name="y_scale")
    zero0 = te.compute((), lambda: zero_of(scale_of()), name="y_zero_point")
    y = te.compute(x.shape, lambda *i: quantize_expr(x(*i), scale0(), zero0(), "uint8"),
                   name="quantize", attrs={QUANTIZE_TAG: "uint8"})
    return [y, scale0, zero0]


def _int_operand(ctx, i: int, role: str):
    if ctx.dtype(i) not in QUANT_DTYPES:
        raise ctx.unsupported(f"{role} of type {ctx.dtype(i)} is not supported (int8 and uint8 only)")


def _shifted(x: te.Tensor, zero: QParam, axis_of, name: str) -> te.Tensor:
    """int32(x) - zero point: an operand whose zero is 0 (padding with 0 is then padding with the zero point)."""
    return te.compute(x.shape, lambda *i: x(*i).astype(ACC) - zero(axis_of(i)).astype(ACC), name=name)


def _shifted_const(ctx, i: int, zero: QParam, axis: int, name: str) -> np.ndarray:
    """A constant int8 operand minus its (per-tensor or per-axis) zero point, as int32."""
    w = ctx.const(i).astype(np.int32)
    z = np.asarray(zero.values).astype(np.int32).reshape(-1)
    if z.size > 1:
        shape = [1] * w.ndim
        shape[axis] = z.size
        z = z.reshape(shape)
    return w - z


def _integer_matmul(ctx, a_i, za_i, b_i, zb_i, name) -> te.Tensor:
    """int32 (a - za) @ (b - zb): za per tensor (or per row of a 2-D a), zb per tensor or per column."""
    _int_operand(ctx, a_i, "A")
    _int_operand(ctx, b_i, "B")
    a_rank, b_rank = len(ctx.shape(a_i)), len(ctx.shape(b_i))
    za = QParam(ctx, za_i, a_rank, a_rank - 2 if a_rank >= 2 else 0, ctx.dtype(a_i), "a_zero_point")
    zb = QParam(ctx, zb_i, b_rank, b_rank - 1, ctx.dtype(b_i), "b_zero_point")
    per_tensor_za = not ctx.has(za_i) or int(np.prod(ctx.shape(za_i), dtype=np.int64)) == 1
    if (ctx.is_const(b_i) and ctx.dtype(b_i) == "int8" and a_rank >= 2 and b_rank == 2 and per_tensor_za
            and zb.values is not None and ctx.shape(a_i)[-1] == ctx.shape(b_i)[0]):
        return _int8_weight_matmul(ctx, ctx.tensor(a_i), za, ctx.const(b_i),
                                   np.asarray(zb.values).reshape(-1).astype(np.int64), name)
    a = _shifted(ctx.tensor(a_i), za, lambda i: i, "a_shifted")
    if ctx.is_const(b_i):
        b = ctx.new_param(_shifted_const(ctx, b_i, zb, b_rank - 1, "b"), f"{ctx.node.input[b_i]}_shifted")
    else:
        b = _shifted(ctx.tensor(b_i), zb, lambda i: i, "b_shifted")
    try:
        return matmul(a, b, name=name)
    except ValueError as exc:
        raise ctx.unsupported(str(exc)) from None


def _int8_weight_matmul(ctx, a: te.Tensor, za: QParam, w: np.ndarray, zw: np.ndarray, name: str) -> te.Tensor:
    """(a - za) @ (w - zw) for a constant int8 weight w[K, N], as the integer GEMM the int8 pass forms
    (te_passes/int8_gemm.py): the plain 8-bit products summed in int32 (marked INT8_GEMM, which the pass
    puts in vpdpbusd's form where the target has VNNI), the zero points compensated after: za per tensor,
    a constant or computed at run time (DynamicQuantizeLinear's), zw per tensor or per column."""
    k_extent, n = w.shape
    r = te.reduce_axis((0, k_extent), name="k")
    w_t = ctx.new_param(w, ctx.node.input[1 if ctx.op_type == "MatMulInteger" else 3])
    out_shape = [*shape_of(a)[:-1], n]
    acc = te.compute(out_shape, lambda *i: te.sum(a(*i[:-1], r).astype(ACC) * w_t(r, i[-1]).astype(ACC), axis=r),
                     name=name, attrs={INT8_GEMM: 0})
    zw = np.broadcast_to(zw, (n,))
    # -za colsum_w[j] + K za zw[j] = za * corr[j]
    corr = ctx.new_param((k_extent * zw - w.astype(np.int64).sum(axis=0)).astype(np.int32), f"{ctx.name}_zero_points")
    rowsum = None
    if np.any(zw != 0):
        zw_t = ctx.new_param(zw.astype(np.int32), f"{ctx.name}_weight_zero_points")
        r2 = te.reduce_axis((0, k_extent), name="k")
        rowsum = te.compute(out_shape[:-1], lambda *i: te.sum(a(*i, r2).astype(ACC), axis=r2), name="row_sums")

    def compensated(*i):
        value = acc(*i) + za(i).astype(ACC) * corr(i[-1])
        return value if rowsum is None else value - zw_t(i[-1]) * rowsum(*i[:-1])

    return te.compute(out_shape, compensated, name="compensated")


@register("MatMulInteger")
def lower_matmul_integer(ctx):
    return [_integer_matmul(ctx, 0, 2, 1, 3, "matmul_integer")]


def _requantized(ctx, acc: te.Tensor, a_scale_i, b_scale_i, y_scale_i, y_zero_i, channel_axis, bias=None):
    """acc (+ int32 bias per channel) requantized with the float32 multiplier a_s * b_s / y_s."""
    for i in (a_scale_i, b_scale_i, y_scale_i):
        _check_float_scale(ctx, i)
        ctx.const(i, "scale")
    out_dtype = ctx.dtype(y_zero_i) if ctx.has(y_zero_i) else "uint8"
    mult = multiplier(ctx.const(a_scale_i).reshape(-1)[0], ctx.const(b_scale_i).reshape(-1),
                      ctx.const(y_scale_i).reshape(-1)[0])
    zy = QParam(ctx, y_zero_i, acc.ndim, channel_axis, out_dtype, "y_zero_point")
    if mult.size == 1:
        m = tirx.const(float(mult[0]), "float32")
        scale_at = lambda idx: m  # noqa: E731
    else:
        m_tensor = ctx.new_param(mult, f"{ctx.name}_multiplier")
        scale_at = lambda idx: m_tensor(idx[channel_axis])  # noqa: E731

    def body(*idx):
        value = acc(*idx) if bias is None else acc(*idx) + bias(idx[channel_axis])
        return requantize_expr(value, scale_at(idx), zy(idx), out_dtype)

    return te.compute(acc.shape, body, name="requantize", attrs={QUANTIZE_TAG: out_dtype})


@register("QLinearMatMul")
def lower_qlinear_matmul(ctx):
    acc = _integer_matmul(ctx, 0, 2, 3, 5, "qlinear_matmul")
    return [_requantized(ctx, acc, 1, 4, 6, 7, acc.ndim - 1)]


def _integer_conv(ctx, x_i, zx_i, w_i, zw_i) -> te.Tensor:
    """int32 convolution of (x - zx) and (w - zw), zw per tensor or per output channel."""
    _int_operand(ctx, x_i, "x")
    _int_operand(ctx, w_i, "w")
    x = ctx.tensor(x_i)
    if x.ndim < 3:
        raise ctx.unsupported(f"input of rank {x.ndim}: a convolution needs [N, C, spatial...]")
    w_shape = ctx.shape(w_i)
    kernel = list(ctx.attr("kernel_shape", w_shape[2:]))
    if list(w_shape[2:]) != kernel or len(w_shape) != x.ndim:
        raise ctx.unsupported(f"weight of shape {list(w_shape)} does not fit kernel_shape {kernel}")
    if ctx.has(zx_i) and int(np.prod(ctx.shape(zx_i), dtype=np.int64)) != 1:
        raise ctx.unsupported("x_zero_point must be per tensor (one value)")
    # a constant or fed at run time (quantize_dynamic's DynamicQuantizeLinear before a ViT's patch embedding):
    # the shifted input x - zx is padded with 0, i.e. x with its zero point, either way
    zx = QParam(ctx, zx_i, x.ndim, 1, dtype_of(x), "x_zero_point")
    zw = QParam(ctx, zw_i, len(w_shape), 0, ctx.dtype(w_i), "w_zero_point")
    shifted_w = _shifted_const(ctx, w_i, zw, 0, "w")
    weight = ctx.new_param(shifted_w, f"{ctx.node.input[w_i]}_shifted")  # blocked by block_conv_weights
    strides, dilations, begin, end = conv_geometry(ctx, shape_of(x)[2:], kernel)
    xs = _shifted(x, zx, lambda i: i, "x_shifted")
    try:
        return conv(xs, weight, int(ctx.attr("group", 1)), strides, dilations, begin, end)
    except ValueError as exc:
        raise ctx.unsupported(str(exc)) from None


CONV_ATTRIBUTES = ["auto_pad", "dilations", "group", "kernel_shape", "pads", "strides"]


@register("ConvInteger", attributes=CONV_ATTRIBUTES)
def lower_conv_integer(ctx):
    return [_integer_conv(ctx, 0, 2, 1, 3)]


@register("QLinearConv", attributes=CONV_ATTRIBUTES)
def lower_qlinear_conv(ctx):
    acc = _integer_conv(ctx, 0, 2, 3, 5)
    bias = None
    if ctx.has(8):
        if ctx.dtype(8) != "int32" or ctx.shape(8) != (shape_of(acc)[1],):
            raise ctx.unsupported(f"bias must be int32 of shape [{shape_of(acc)[1]}]")
        bias = ctx.tensor(8)
    return [_requantized(ctx, acc, 1, 4, 6, 7, 1, bias)]


@register("QLinearAdd", "QLinearMul")
def lower_qlinear_binary(ctx):
    """com.microsoft QLinearAdd / QLinearMul: dequantize both, add or multiply in float32, quantize
    (ONNX Runtime's kernels compute in float too, with a precomputed reciprocal: within one step)."""
    _int_operand(ctx, 0, "A")
    _int_operand(ctx, 3, "B")
    shape = broadcast_shape(ctx.shape(0), ctx.shape(3))
    params = []
    for q_i, s_i, z_i in ((0, 1, 2), (3, 4, 5), (None, 6, 7)):
        _check_float_scale(ctx, s_i)
        dtype = ctx.dtype(q_i) if q_i is not None else (ctx.dtype(7) if ctx.has(7) else ctx.dtype(0))
        if ctx.has(s_i) and int(np.prod(ctx.shape(s_i))) != 1:
            raise ctx.unsupported("per-axis scales are not supported for QLinearAdd / QLinearMul")
        params.append((QParam(ctx, s_i, len(shape), 0, "float32", "scale"),
                       QParam(ctx, z_i, len(shape), 0, dtype, "zero_point"), dtype))
    a, b = ctx.tensor(0), ctx.tensor(3)
    (sa, za, _), (sb, zb, _), (sy, zy, out_dtype) = params
    combine = (lambda u, v: u + v) if ctx.op_type == "QLinearAdd" else (lambda u, v: u * v)

    def body(*idx):
        u = dequantize_expr(read(a, idx, shape), sa(idx), za(idx))
        v = dequantize_expr(read(b, idx, shape), sb(idx), zb(idx))
        return quantize_expr(combine(u, v), sy(idx), zy(idx), out_dtype)

    return [te.compute(shape, body, name=ctx.op_type.lower(), attrs={QUANTIZE_TAG: out_dtype})]
