"""Grouped convolutions with small groups computed as dense convolutions over channel blocks (CPU backend).

A grouped convolution reads, for output channel f, the Cg input channels of f's group: X[f // Cg * Cg + rc].
Its schedule vectorizes over B output channels (the weight's block), whose lanes then read B / Cg different
input channels per reduction step: a gather of the input on every step (ResNeXt-101's first stage, 4
channels per group: ~22 GFLOP/s). With the B-channel block's weights stored block-diagonally,
Wd[f // B, c, r, s, f % B] = W[f, c - (f % B) // Cg * Cg, r, s] inside f's group and 0 outside, the same
convolution reads X[f // B * B + c] for c < B: one input value per step, broadcast over the lanes, as a
dense convolution does. That costs B / Cg times the multiply-adds, so it is done only where the groups
are at most `max_group` channels and B / Cg at most MAX_EXPANSION (4-channel groups on AVX-512: 4x the
work at ~6x the speed, 2.6 -> 1.8 ms per conv; 8-channel groups would break even, and depthwise
convolutions, one channel per group, have a channel-vectorized schedule of their own).
Groups that straddle the blocks (neither the group nor the block divides the other: Visformer's 24-channel
groups under 16 lanes) gather from two groups per vector whatever their size, with a division by the group
per lane: ~2.6 GFLOP/s, 5.6x ONNX Runtime's latency for the model. They are densified over the window of
groups a block touches: Wd[f // B, c, r, s, f % B] over c < W, read at X[start(f // B) + c], start the first
touched group's first channel (moved down so that the window stays inside the C channels), W the widest such
window (48 for 24-channel groups: 2x the multiply-adds at full vector speed).
Values are unchanged up to the added zero products.
"""

from __future__ import annotations

import logging

import numpy as np
import tvm
from tvm import te

from souffle_py.ir.program import TEProgram
from souffle_py.ir.exprs import substitute
from souffle_py.ir.graph import sweep, tensor_key
from te_passes.patterns import conv2d

log = logging.getLogger(__name__)

MAX_EXPANSION = 4  # at most this many times the multiply-adds of the grouped convolution


def densify_small_groups(program: TEProgram, max_group: int) -> TEProgram:
    """`program` with each grouped convolution of at most `max_group` channels per group (and more than one
    group per weight block) computed over block-diagonal weights (module docstring)."""
    params, param_tensors = dict(program.params), dict(program.param_tensors)

    def rewrite(op, reads):
        found = _small_groups(program, op, max_group)
        if found is None:
            return None
        data, weight, group, rc = found
        original = weight.args[0].op.name
        name = f"{original}_dense"
        channels = int(data.args[0].shape[1])
        if name not in param_tensors:  # a weight shared by several convs is expanded once
            params[name] = _block_diagonal(program.params[original], group, channels)
            param_tensors[name] = te.placeholder(params[name].shape, "float32", name=name)
        return _dense_conv(op, data, weight, param_tensors[name], rc, reads, group, channels)

    new_of, count = sweep(program.stages, rewrite)
    if not count:
        return program
    log.info("%d grouped convolutions with small groups computed over block-diagonal weights", count)
    return program.rebuilt(new_of, params, param_tensors)


def _small_groups(program: TEProgram, op, max_group: int):
    """(data read, weight read, channels per group, the group's reduction axis) when `op` is a grouped
    convolution X[.., f // Cg * Cg + rc, ..] * W[f // B, rc, r, s, f % B] with 1 < Cg <= max_group and
    1 < B / Cg <= MAX_EXPANSION, or groups straddling the blocks whose window is at most MAX_EXPANSION groups
    (module docstring); else None."""
    found = conv2d(op)
    if found is None:
        return None
    data, weight = found.data, found.weight
    w = weight.args[0]
    if not isinstance(w.op, te.PlaceholderOp) or program.placeholder_kind(w) != "param" or str(w.dtype) != "float32":
        return None
    group, block = int(w.shape[1]), int(w.shape[-1])
    channels = int(data.args[0].shape[1])
    if group >= channels:
        return None  # dense
    if group == 1:  # depthwise: a channel-vectorized schedule of its own; under 4-channel weight blocks (AVX2's
        return None  # 8, 4 at 12 or 60 channels; NEON's 4) it was densified, 4x the FMAs and lanes gathered
    straddles = block % group != 0 and group % block != 0
    if straddles:
        if channels % group or channels % block or int(op.output(0).shape[1]) != channels or \
                _window(group, block, channels) > MAX_EXPANSION * group:
            return None
    elif group > max_group or block % group or not 1 < block // group <= MAX_EXPANSION:
        log.info("%s keeps its groups: %d channels per group, weight blocks of %d", op.name, group, block)
        return None
    rc = next((iv for iv in op.reduce_axis if int(iv.dom.extent) == group and weight.args[2].same_as(iv.var)), None)
    f = op.axis[1].var
    if rc is None:
        return None
    analyzer = tvm.sym.Analyzer()
    for iv in list(op.axis) + list(op.reduce_axis):
        analyzer.bind(iv.var, iv.dom)
    offset = analyzer.simplify(data.args[2] - rc.var - f // group * group)
    expected = [f // block, rc.var, None, None, f % block]
    weight_ok = all(e is None or analyzer.can_prove_equal(a, e) for a, e in zip(weight.args[1:], expected))
    if not (isinstance(offset, tvm.tirx.IntImm) and offset.value == 0 and weight_ok):
        return None
    return data, weight, group, rc


def _window(group: int, block: int, channels: int) -> int:
    """Input channels a block of output channels reads: the block where groups divide it, else the widest
    run of whole groups that one block touches (module docstring)."""
    if block % group == 0:
        return block
    return max(((q * block + block - 1) // group - q * block // group + 1) * group
               for q in range(channels // block))


def _start(q, group: int, block: int, width: int, channels: int, minimum=min):
    """The first input channel of block q's window of `width` channels: an int, or with `minimum` te.min
    an expression of a TE's block index q (the one formula for the weight and the read)."""
    if block % group == 0:
        return q * block
    return minimum(q * block // group * group, channels - width)


def _block_diagonal(value: np.ndarray, group: int, channels: int) -> np.ndarray:
    """W[F / B, Cg, kh, kw, B] as Wd[F / B, W, kh, kw, B]: lane i of block q has its Cg weights at rows
    g * Cg - start(q) onwards, g its group (W and start: `_window`, `_start`)."""
    blocks, _, kh, kw, block = value.shape
    width = _window(group, block, channels)
    dense = np.zeros((blocks, width, kh, kw, block), value.dtype)
    for q in range(blocks):
        start = _start(q, group, block, width, channels)
        for lane in range(block):
            row = (q * block + lane) // group * group - start
            dense[q, row:row + group, :, :, lane] = value[q, :, :, :, lane]
    return dense


def _dense_conv(op, data, weight, dense, rc, mapping, group: int, channels: int) -> te.Operation:
    """`op` reading X[.., start(f // B) + c, ..] * Wd[f // B, c, r, s, f % B] over c < W (`_start`, `_window`;
    start f // B * B and W = B where the groups divide the block)."""
    block = int(dense.shape[-1])
    width = int(dense.shape[1])
    c = te.reduce_axis((0, width), name="c")
    others = [iv for iv in op.reduce_axis if not iv.same_as(rc)]
    x = mapping.get(tensor_key(data.args[0]), data.args[0])
    handles = [iv.var.__chandle__() for iv in op.axis]

    def dense_conv(*axes):
        subst = dict(zip(handles, axes))
        n, y, xx = (substitute(data.args[i], subst) for i in (1, 3, 4))
        fo = axes[1]
        weights = [substitute(a, {**subst, rc.var.__chandle__(): c.var}) for a in weight.args[1:]]
        start = _start(fo // block, group, block, width, channels, te.min)
        return te.sum(x[n, start + c, y, xx] * dense[fo // block, c, weights[2], weights[3], fo % block],
                      axis=[c, *others])
    return te.compute(op.output(0).shape, dense_conv, name=op.name, tag=op.tag).op
