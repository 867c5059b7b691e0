"""Integer convolutions from QDQ chains: a float32 convolution (block_conv_weights' form) of a
dequantized int8 input (per-tensor scale and zero point, possibly through the zero padding TE) and a
dequantized constant int8 weight (symmetric: zero points 0, as ONNX Runtime makes int8 weights; scale per
tensor or per output channel) becomes an int8 x int8 convolution summed in int32:

    sum (x - zx) sx w[f] sw[f] = sx sw[f] (sum x w[f]  -  zx sum w[f])

The input is padded with its zero point zx (the dequantized 0.0), so the compensation -zx sum w[f] (over
channels and taps) holds at the borders too; it is computed here into one int32 vector per output
channel. The weight is stored int8 in the blocked layout the float convolution read. Marked INT8_CONV.
"""

from __future__ import annotations

import numpy as np
import tvm
import tvm_ffi
from tvm import te, tirx

from souffle_py.ir.exprs import substitute
from te_passes.int8_conv_vnni import INT8_CONV, vnni_conv
from te_passes.int8_gemm import SCALED
from te_passes.int8_reads import add_param, dequantized, is_load, product_reads
from te_passes.quant import ACC

def integer_conv(program, op, params, param_tensors, vnni_lanes: int = 0, copies=None,
                 split: bool = False, may_saturate=None) -> te.ComputeOp | None:
    """The integer convolution replacing `op` (its output, element for element), or None. `vnni_lanes` (16
    where the target has AVX512_VNNI): vpdpbusd's form (int8_conv_vnni.py) where the shape allows, its input
    copies shared through `copies`, its weight split into int16 halves where `split` (dot_weights.py;
    `may_saturate`: pair_form)."""
    found = product_reads(op)
    if found is None or len(op.axis) < 3:
        return None
    _, (x_load, w_load) = found
    weight = _blocked_weight(program, w_load)
    padded = _padded_input(program, x_load)
    if weight is None or padded is None:
        return None
    blocked_int8, w_int8, w_scale = weight
    x_int, zx, sx = padded
    channels = int(op.output(0).shape[1])
    if w_int8.shape[0] != channels:
        return None
    colsum = w_int8.astype(np.int64).reshape(channels, -1).sum(axis=1)
    scale = (np.float32(sx) * np.broadcast_to(w_scale.reshape(-1), (channels,))).astype(np.float32)
    base = op.name
    vnni = (vnni_conv(op, x_load, x_int, w_load, w_int8, vnni_lanes, params, param_tensors, copies, split,
                      int(zx), may_saturate) if vnni_lanes else None)
    if vnni is not None:  # its input shifted into uint8 where it was int8: the zero point with it
        acc_t, shift = vnni
        zx += shift
    else:
        w_t = add_param(params, param_tensors, blocked_int8, f"{base}_weight_int8")
        source = x_int(*x_load.args[1:]).astype(ACC) * w_t(*w_load.args[1:]).astype(ACC)
        acc_t = te.ComputeOp(f"{base}_acc", op.tag, {INT8_CONV: 1}, op.axis, op.reduce_axis,
                             [te.sum(source, axis=list(op.reduce_axis))]).output(0)
    corr = (-zx * colsum).astype(np.int32)
    corr_t = add_param(params, param_tensors, corr, f"{base}_zero_points")
    scale_t = add_param(params, param_tensors, scale, f"{base}_scales")
    shape = [int(d) for d in op.output(0).shape]
    return te.compute(shape, lambda n, f, *rest: (acc_t(n, f, *rest) + corr_t(f)).astype("float32") * scale_t(f),
                      name=base, attrs={SCALED: 1}).op


def _blocked_weight(program, load):
    """(the int8 weight in the read tensor's blocked layout [F/B, C/g, *k, B], the int8 weight [F, C/g, *k],
    its scales) where `load` reads the blocked copy (block_conv_weights) of a dequantized symmetric int8
    constant; else None."""
    tensor = load.args[0]
    op = tensor.op
    if not isinstance(op, te.ComputeOp) or op.reduce_axis or not is_load(op.body[0]):
        return None
    inner = op.body[0]
    deq = dequantized(program, inner)
    if deq is None or deq.source.op.name not in program.params or np.any(deq.zero != 0):
        return None
    if deq.scale.size > 1 and deq.axis != 0:
        return None
    w = np.asarray(program.params[deq.source.op.name])
    shape = [int(d) for d in tensor.shape]
    block = shape[-1]
    fo, *middle, b = [iv.var for iv in op.axis]
    expected = [fo * block + b, *middle]
    analyzer = tvm.sym.Analyzer()
    if len(deq.indices) != len(expected) or not all(
            analyzer.can_prove_equal(got, want) for got, want in zip(deq.indices, expected)):
        return None  # not the plain blocked copy
    blocked = w.reshape(w.shape[0] // block, block, *w.shape[1:]).transpose(0, *range(2, w.ndim + 1), 1)
    return np.ascontiguousarray(blocked), w, deq.scale


def _padded_input(program, load):
    """(an int8 TE standing for the read tensor, zx, sx) where `load` reads a dequantized int8 tensor with a
    per-tensor scale and zero point, directly or through a zero padding TE (then padded with zx instead)."""
    tensor = load.args[0]
    deq = dequantized(program, load)
    if deq is not None:  # element-wise: the int8 tensor is read where the dequantized one was
        same = [int(d) for d in deq.source.shape] == [int(d) for d in tensor.shape] and all(
            tvm_ffi.structural_equal(a, b) for a, b in zip(deq.indices, load.args[1:]))
        found = _per_tensor(deq)
        return (deq.source, *found) if same and found is not None else None
    op = tensor.op
    if not isinstance(op, te.ComputeOp) or op.reduce_axis or len(op.body) != 1:
        return None
    body = op.body[0]
    if not (isinstance(body, tvm.ir.Call) and getattr(body.op, "name", "").endswith(".if_then_else")):
        return None
    cond, inside, outside = body.args
    if not is_load(inside) or not isinstance(outside, tirx.FloatImm) or outside.value != 0.0:
        return None
    deq = dequantized(program, inside)
    if deq is None:
        return None
    found = _per_tensor(deq)
    if found is None:
        return None
    zx, sx = found
    dtype = str(deq.source.dtype)
    pad_value = tirx.const(zx, dtype)
    axes = [iv.var for iv in op.axis]

    def padded(*idx):
        mapping = {v.__chandle__(): i for v, i in zip(axes, idx)}
        return tirx.if_then_else(substitute(cond, mapping),
                                 deq.source(*[substitute(e, mapping) for e in deq.indices]), pad_value)

    shape = [int(d) for d in tensor.shape]
    return te.compute(shape, padded, name=f"{op.name}_int8"), zx, sx


def _per_tensor(deq):
    """(zero point, scale) of a per-tensor dequantization; None for per-axis."""
    if deq.zero.size != 1 or deq.scale.size != 1:
        return None
    return int(deq.zero.reshape(-1)[0]), float(deq.scale.reshape(-1)[0])
