"""Squeeze-and-excite's channel scale folded into the pointwise convolution that reads it (CPU backend).

EfficientNet's MBConv block scales its depthwise output by a per-channel gate, X[n, c, y, x] * G[0, c, 0, 0],
and a dense 1x1 convolution (the project conv) is the scaled map's only reader. The convolution is linear
in each input channel, so

    sum_c W[f, c] * (X[c, p] * G[c])  ==  sum_c (W[f, c] * G[c]) * X[c, p]:

the gate can scale the weight (F x C values) instead of the map (C x H x W values). Where the weight is
the smaller of the two (every block up to 14 x 14 maps), one whole read-and-write pass over the largest
feature map of the block goes away, and the convolution reads the depthwise output directly. The product
is reassociated, so values change by float32 rounding only. Batch 1 only: with a batch the gate differs
per image while the weight is shared.
"""

from __future__ import annotations

import logging

import tvm
from tvm import te

from souffle_py.ir.program import TEProgram
from souffle_py.ir.exprs import substitute
from souffle_py.ir.graph import map_loads, sweep, tensor_key
from te_passes.patterns import conv2d

log = logging.getLogger(__name__)


def fold_channel_scales(program: TEProgram) -> TEProgram:
    """`program` with each channel scale X * G read only by a dense 1x1 convolution folded into that
    convolution's weight, where the weight has fewer elements than the scaled map."""
    consumers = program.consumers()
    outputs = {t.op for t in program.outputs.values()}
    def rewrite(op, reads):
        found = _foldable(op, consumers, outputs)
        return None if found is None else _folded_conv(op, *found, reads)

    new_of, folded = sweep(program.stages, rewrite)
    if not folded:
        return program
    log.info("folded %d squeeze-and-excite scales into pointwise conv weights", folded)
    return program.rebuilt(new_of)


def _foldable(op, consumers, outputs):
    """(the conv's read of the scaled map, its weight read, the scale's data expression and gate expression,
    both over the scale's axes) when `op` is a dense 1x1 convolution over a channel scale it alone reads
    and whose weight is smaller than the map; else None."""
    found = conv2d(op)
    if found is None:
        return None
    data, weight = found.data, found.weight
    scale, w = found.data_tensor, found.weight_tensor
    channel = data.args[2]
    reduce_vars = {iv.var.__chandle__(): int(iv.dom.extent) for iv in op.reduce_axis}
    if (not isinstance(channel, tvm.tirx.Var) or channel.__chandle__() not in reduce_vars
            or not weight.args[2].same_as(channel) or any(int(d) != 1 for d in w.shape[2:4])
            or int(op.axis[0].dom.extent) != 1):
        return None  # grouped, not 1x1, or batched
    if (not isinstance(scale.op, te.ComputeOp) or scale.op.reduce_axis or scale.op.num_outputs != 1
            or scale.op in outputs or len(consumers.get(scale.op, [])) != 1):
        return None
    parts = _scale_parts(scale.op)
    if parts is None:
        return None
    filters = int(w.shape[0]) * int(w.shape[-1])
    channels, height, width = (int(d) for d in scale.shape[1:])
    if filters * channels >= channels * height * width:
        log.info("%s keeps its input scale: the weight (%d x %d) is larger than the map", op.name, filters, channels)
        return None
    return data, weight, *parts


def _scale_parts(op):
    """(data, gate): the body of `op` as data * gate, the gate a read of a [1, C, 1, 1] tensor at the
    output channel and the data a single read; else None."""
    body = op.body[0]
    if not isinstance(body, tvm.tirx.Mul):
        return None
    c = op.axis[1].var
    for data, gate in ((body.a, body.b), (body.b, body.a)):
        if (_is_load(data) and _is_load(gate) and [int(d) for d in gate.args[0].shape] == [1, int(op.axis[1].dom.extent), 1, 1]
                and gate.args[2].same_as(c) and all(isinstance(i, tvm.tirx.IntImm) for i in (gate.args[1], *gate.args[3:]))):
            return data, gate
    return None


def _is_load(expr) -> bool:
    return isinstance(expr, tvm.ir.Call) and expr.op.same_as(tvm.ir.Op.get("te.tensor_load"))


def _folded_conv(op, scale_load, weight_load, data, gate, new_of) -> te.ComputeOp:
    """`op` reading the scale's data where it read the scaled map, and the weight scaled by the gate of
    its input channel (a small TE of the weight's shape) where it read the weight."""
    scale_op, w = scale_load.args[0].op, weight_load.args[0]
    w = new_of.get(tensor_key(w), w)
    axes = [iv.var.__chandle__() for iv in scale_op.axis]
    gate = map_loads(gate, lambda t, idx: new_of[tensor_key(t)](*idx) if tensor_key(t) in new_of else None)
    data = map_loads(data, lambda t, idx: new_of[tensor_key(t)](*idx) if tensor_key(t) in new_of else None)

    def scaled(fb, c, r, s, fi):
        return w[fb, c, r, s, fi] * substitute(gate, {axes[1]: c})
    weight = te.compute(tuple(int(d) for d in w.shape), scaled, name=f"{op.name}_weight_scaled")
    read_data = substitute(data, dict(zip(axes, scale_load.args[1:])))

    def redirect(tensor, indices):
        if tensor.op.same_as(scale_op):
            return read_data
        if tensor.op.same_as(weight_load.args[0].op):
            return weight(*indices)
        new = new_of.get(tensor_key(tensor))
        return None if new is None else new(*indices)
    body = [map_loads(b, redirect) for b in op.body]
    return te.ComputeOp(op.name, op.tag, op.attrs, op.axis, op.reduce_axis, body)
