"""Max pooling of a dequantized int8 map requantized at the same scale and zero point (the QDQ form of a
pool: DequantizeLinear -> [pad] -> MaxPool -> QuantizeLinear, ResNet's stem), pooled in int8 directly.

Dequantizing is increasing (a positive scale), so the max of the dequantized window is the dequantized
max, and quantizing it back at the same scale and zero point returns that int8 value exactly: (q - z) * s
/ s rounds to q - z for every 8-bit q. The float32 padding (the type's lowest value, never chosen where a
window holds a point of the map, as in every pool whose padding is smaller than its window) becomes the
integer type's lowest. ONNX Runtime's QDQ transformer runs such a pool on the int8 map as well. In float32
the three passes (pad, pool, quantize) cost ResNet-50 int8 0.6 ms, 5% of its time. A padded pool of a map
that a VNNI conv with channels in the lanes computes runs channels-last (`_channels_last`: ResNet's stem,
3% of its int8 time); any other strided one reads a phase-split copy of its padded input.
"""

from __future__ import annotations

import numpy as np
import tvm
import tvm_ffi
from tvm import te, tirx

from souffle_py.ir.analysis.body import IF_THEN_ELSE
from souffle_py.ir.exprs import substitute
from souffle_py.ir.graph import TENSOR_LOAD
from souffle_py.ir.marks import LAYOUT_COPY
from te_passes.int8_conv_vnni import INT8_CONV, PIXEL_LANES
from te_passes.int8_reads import dequantized, is_load
from te_passes.int8_requant import quantize_of_map
from te_passes.quant import QUANTIZE_TAG


def integer_max_pool(program, op) -> te.ComputeOp | None:
    """The int8 max pool replacing the QuantizeLinear TE `op`, or None where the pattern does not hold."""
    found = quantize_of_map(program, op)
    if found is None:
        return None
    x_load, y_scale, y_zero, dtype = found
    pool = x_load.args[0].op
    if not _is_max(pool):
        return None
    reduce = pool.body[0]
    window = reduce.source[0]
    if not is_load(window):
        return None
    lowest = tirx.const(int(np.iinfo(dtype).min), dtype)
    inner = window.args[0].op
    direct = _integer_read(program, window, (y_scale, y_zero, dtype))
    if direct is not None:  # no padding: the pool reads the DQ itself
        source = direct
    else:
        stride = _column_stride(pool, window)
        nhwc = _channels_last(program, (op, pool, window, inner), lowest, (y_scale, y_zero, dtype))
        if nhwc is not None:
            return nhwc
        padded = _padded(program, inner, lowest, (y_scale, y_zero, dtype), stride)
        if padded is None:
            return None
        source = padded(*_phase_split(pool, window.args[1:], stride))
    return te.ComputeOp(op.name, pool.tag, {QUANTIZE_TAG: dtype}, pool.axis, pool.reduce_axis,
                        [te.max(source, axis=list(pool.reduce_axis))])


def _channels_last(program, ops, lowest, quant) -> te.ComputeOp | None:
    """The pool computed channels-last, [N, OH, OW, C], where a VNNI conv with channels in the lanes
    computes its int8 map (ResNet's stem): the pool reads the map's channels innermost, so the conv's
    write-back stores it NHWC, whole channel vectors (schedule/int8_conv.py), each tap one vector, the
    padding a condition (no padded map, no phase-split copy); the pool's NCHW readers read its map
    transposed. None where the map is not such a conv's."""
    op, pool, window, pad = ops
    if not isinstance(pad, te.ComputeOp) or pad.reduce_axis or len(pad.body) != 1 or len(pool.axis) != 4:
        return None
    body = pad.body[0]
    if not (isinstance(body, tvm.ir.Call) and body.op.same_as(IF_THEN_ELSE)) or _reads_tensors(body.args[0]):
        return None
    condition, inside, outside = body.args
    found = dequantized(program, inside) if is_load(inside) else None
    if (found is None or _integer_read(program, inside, quant) is None or len(found.indices) != 4
            or not (isinstance(outside, tirx.FloatImm) and outside.value <= -3.4e38)
            or not _from_channel_lane_conv(found.source)):
        return None
    source = found.source
    height, width = (int(d) for d in source.shape[2:])
    at_window = {iv.var.__chandle__(): i for iv, i in zip(pad.axis, window.args[1:])}
    inside_rows = [substitute(e, at_window) for e in found.indices]
    b, c, y, x = inside_rows
    clamped = source[b, c, tirx.max(tirx.min(y, height - 1), 0), tirx.max(tirx.min(x, width - 1), 0)]
    value = tirx.if_then_else(substitute(condition, at_window), clamped, lowest)
    n, c_axis, h_axis, w_axis = (iv.var for iv in pool.axis)
    shape = [int(iv.dom.extent) for iv in pool.axis]

    def pooled_at(bb, yy, xx, cc):
        at = {n.__chandle__(): bb, c_axis.__chandle__(): cc, h_axis.__chandle__(): yy, w_axis.__chandle__(): xx}
        return te.max(substitute(value, at), axis=list(pool.reduce_axis))
    pooled = te.compute((shape[0], shape[2], shape[3], shape[1]), pooled_at, name=f"{op.name}_nhwc",
                        tag=pool.tag, attrs={QUANTIZE_TAG: quant[2]})
    return te.compute(shape, lambda bb, cc, yy, xx: pooled[bb, yy, xx, cc], name=op.name).op


def _from_channel_lane_conv(tensor) -> bool:
    """Whether `tensor` is computed from a VNNI conv's sum with its channels in the lanes (its requantization)."""
    op = tensor.op
    return isinstance(op, te.ComputeOp) and any(
        int((t.op.attrs or {}).get(INT8_CONV, 0)) > 1 and PIXEL_LANES not in (t.op.attrs or {})
        for t in op.input_tensors)


def _is_max(op) -> bool:
    """A max reduction of one float32 read (topi's pool: a NaN-propagating select, or max)."""
    if not isinstance(op, te.ComputeOp) or len(op.body) != 1 or not isinstance(op.body[0], tirx.Reduce):
        return False
    reduce = op.body[0]
    if len(reduce.source) != 1 or str(op.output(0).dtype) != "float32":
        return False
    result = reduce.combiner.result[0]
    identity = reduce.combiner.identity_element[0]
    lowest = isinstance(identity, tirx.FloatImm) and (identity.value == -np.inf or identity.value <= -3.4e38)
    return lowest and (isinstance(result, tirx.Max) or isinstance(result, tirx.Select)
                       and isinstance(result.true_value, tirx.Var) and isinstance(result.false_value, tirx.Var))


def _integer_read(program, load, quant):
    """The read of the integer map behind `load`, where `load` reads a per-tensor DequantizeLinear of a
    map of `quant`'s type at its scale and zero point, else None."""
    scale, zero, dtype = quant
    found = dequantized(program, load)
    if (found is None or str(found.source.dtype) != dtype or found.scale.size != 1 or found.zero.size != 1
            or np.float32(found.scale[0]) != np.float32(scale) or not found.scale[0] > 0
            or int(found.zero[0]) != zero):
        return None
    return found.source(*found.indices)


def _column_stride(pool, window) -> int:
    """The step of the window's column read per output column (the pool's stride along W; 1 if unknown)."""
    column = window.args[-1]
    w = pool.axis[-1].var
    step = tvm.sym.Analyzer().simplify(substitute(column, {w.__chandle__(): tirx.const(1, "int32")})
                                       - substitute(column, {w.__chandle__(): tirx.const(0, "int32")}))
    return int(step.value) if isinstance(step, tirx.IntImm) and step.value > 1 else 1


def _phase_split(pool, indices, stride: int) -> list:
    """The window's read of the padded map in its phase-split layout [.., H, stride, W / stride]: column c
    at (c % stride, c // stride), which for c = stride * w + r is (r % stride, w + r // stride), contiguous
    along w for every tap r, where the map's own layout strides by `stride` (a gather per vector)."""
    if stride == 1:
        return list(indices)
    analyzer = tvm.sym.Analyzer()
    for iv in [*pool.axis, *pool.reduce_axis]:
        analyzer.bind(iv.var, tvm.ir.Range(0, int(iv.dom.extent)))
    column = indices[-1]
    return [*indices[:-1], analyzer.simplify(tirx.floormod(column, stride)),
            analyzer.simplify(tirx.floordiv(column, stride))]


def _padded(program, pad, lowest, quant, stride: int = 1):
    """The pad `pad` (if_then_else(inside, DQ read, lowest float)) over the integer map, as a new TE, and
    for a strided pool its copy in the phase-split layout `_phase_split` reads (columns past the map's at
    `lowest`); None where `pad` is not such a pad."""
    if not isinstance(pad, te.ComputeOp) or pad.reduce_axis or len(pad.body) != 1:
        return None
    body = pad.body[0]
    if not (isinstance(body, tvm.ir.Call) and body.op.same_as(IF_THEN_ELSE)):
        return None
    condition, inside, outside = body.args
    read = _integer_read(program, inside, quant) if is_load(inside) else None
    if read is None or not (isinstance(outside, tirx.FloatImm) and outside.value <= -3.4e38):
        return None
    if _reads_tensors(condition):
        return None
    value = tirx.if_then_else(condition, read, lowest)
    padded = te.ComputeOp(f"{pad.name}_int8", pad.tag, pad.attrs, pad.axis, [], [value]).output(0)
    if stride == 1:
        return padded
    *rest, width = (int(d) for d in padded.shape)

    def split(*i):  # the int8 map's phase-split copy: a pad with the requantization composed in stays a
        column = i[-1] * stride + i[-2]  # pad (its rows vectorized between the borders, rules/padding.py)
        value = padded(*i[:-2], tirx.min(column, width - 1))
        return value if width % stride == 0 else tirx.if_then_else(column < width, value, lowest)
    return te.compute([*rest, stride, -(-width // stride)], split, name=f"{pad.name}_phases",
                      attrs={LAYOUT_COPY: 1})  # a copy the vertical pass leaves apart


def _reads_tensors(expr) -> bool:
    found = []
    tvm_ffi.structural_walk(expr, [(tvm.ir.Call, lambda c: found.append(True) if c.op.same_as(TENSOR_LOAD) else None)])
    return bool(found)
