"""Pointwise convolutions as GEMMs over flattened feature maps (CPU backend).

A dense 1x1 convolution with stride 1 and no padding over an NCHW map is the GEMM
out[f, p] = sum_c W[f, c] * X[c, p] with p = y * W + x: every row of X is contiguous. The conv schedule
vectorizes over output channels, which for EfficientNet's project convs (16-40 output channels, 8-channel
weight blocks) means 8-lane vectors and one broadcast input value per FMA, and an output transposed into
NCHW element by element (50-55 GFLOP/s at 56 x 56 here). As a GEMM the register tile is 8 channels x 32
columns of p: two 16-lane vectors of X per reduction step, each shared by 8 weight broadcasts, stored as
whole vectors (88-103 GFLOP/s on the same shapes).

Vectors along p need the map stored flat: X[n, c, p // W, p % W] is not affine in p, and TVM gathers it
lane by lane. So the convolution's input is computed as [N, C, H * W] by its producer, and so is that
producer's own full-size input when it comes from a depthwise convolution (the SiLU between them then
runs over flat rows too): a depthwise convolution vectorizes over channels and unrolls its output
positions, so its flat output index costs nothing in vector lanes. Readers of a flattened tensor read
T[n, c, y * W + x], contiguous along x. Values are unchanged; only where tensors live changes. Maps whose
H * W is not a multiple of the vector (14 x 14, 7 x 7) keep the convolution.
"""

from __future__ import annotations

import logging

import tvm
from tvm import te

from souffle_py.program import TEProgram
from te_passes.exprs import simplify_reads, substitute
from te_passes.graph import map_loads, read_through, sweep, tensor_key, tensor_loads
from te_passes.recurrence import member_of

log = logging.getLogger(__name__)


def pointwise_convs_as_gemms(program: TEProgram, lanes: int) -> TEProgram:
    """`program` with each dense 1x1 stride-1 convolution over an H x W map (H * W a multiple of `lanes`)
    whose input can be computed flat (see the module docstring) computed as a GEMM over [N, C, H * W]."""
    outputs = {t.op for t in program.outputs.values()}
    convs, flat = {}, set()
    for op in program.stages:
        found = _pointwise(op, lanes)
        if found is None or op in outputs:
            continue
        chain = _flattenable(found[0].args[0].op, outputs)
        if chain is None:
            log.info("%s stays a convolution: its input cannot be stored flat", op.name)
            continue
        convs[op] = found
        flat |= chain
    if not convs:
        return program
    def rewrite(op, reads):
        if op not in convs and op not in flat:
            return None
        new = _as_gemm(op, *convs[op], reads) if op in convs else _flat(op, reads)
        width = int(op.output(0).shape[3])
        return new, lambda n, c, y, x, t=new.output(0), w=width: t[n, c, y * w + x]

    new_of, _ = sweep(program.stages, rewrite)
    log.info("%d pointwise convs as GEMMs over flat maps (%d producers stored flat)", len(convs), len(flat))
    return program.rebuilt(new_of)


def conv_reads(op):
    """(the [data] read, the [weight] read) of a 4-D convolution TE outside recurrences (a reduction over
    the product of one map read and one weight read); else None."""
    if (not isinstance(op, te.ComputeOp) or len(op.axis) != 4 or member_of(op) is not None or len(op.body) != 1
            or not isinstance(op.body[0], tvm.tirx.Reduce) or not isinstance(op.body[0].source[0], tvm.tirx.Mul)):
        return None
    loads = tensor_loads(op.body[0].source[0])
    data = [ld for ld in loads if len(ld.args) == 5]
    weight = [ld for ld in loads if len(ld.args) == 6]
    if len(loads) != 2 or len(data) != 1 or len(weight) != 1:
        return None
    return data, weight


def _pointwise(op, lanes: int):
    """(the data read, the weight read) when `op` is a dense 1x1 stride-1 unpadded convolution over a map
    of H * W points, a multiple of `lanes`; else None."""
    reads = conv_reads(op)
    if reads is None or str(op.output(0).dtype) != "float32":
        return None
    data, weight = reads
    x, w = data[0].args[0], weight[0].args[0]
    extents = {iv.var.__chandle__(): int(iv.dom.extent) for iv in op.reduce_axis}
    unit = {h: tvm.tirx.IntImm("int32", 0) for h, e in extents.items() if e == 1}
    channel = data[0].args[2]
    if (not isinstance(channel, tvm.tirx.Var) or extents.get(channel.__chandle__()) != int(x.shape[1])
            or not weight[0].args[2].same_as(channel) or len(op.reduce_axis) != 3
            or any(int(d) != 1 for d in w.shape[2:4]) or [int(d) for d in x.shape[2:]] != [int(d) for d in op.output(0).shape[2:]]):
        return None
    analyzer = tvm.sym.Analyzer()
    for i, (got, axis) in enumerate(zip(data[0].args[1:], op.axis)):
        got = analyzer.simplify(substitute(got, unit))
        batch_one = i == 0 and int(axis.dom.extent) == 1 and isinstance(got, tvm.tirx.IntImm)
        if i != 1 and not got.same_as(axis.var) and not batch_one:
            return None
    if (int(x.shape[2]) * int(x.shape[3])) % lanes:
        return None
    return data[0], weight[0]


def _flattenable(op, outputs) -> set | None:
    """The ops to store flat so that `op`'s output can be: itself when it is a depthwise convolution over
    channel blocks, or an elementwise op with the depthwise convolutions whose full-size outputs it reads;
    None when some full-size read could not be flat (a residual input, a graph input)."""
    if _is_blocked_conv(op) and op not in outputs:
        return {op}
    if not isinstance(op, te.ComputeOp) or op.reduce_axis or op.num_outputs != 1 or op in outputs or len(op.axis) != 4:
        return None
    spatial = [int(d) for d in op.output(0).shape[2:]]
    chain = {op}
    for load in tensor_loads(op.body[0]):
        t = load.args[0]
        if len(t.shape) == 4 and [int(d) for d in t.shape[2:]] == spatial and spatial != [1, 1]:
            if not _is_blocked_conv(t.op) or t.op in outputs:
                return None
            chain.add(t.op)
    return chain


def _is_blocked_conv(op) -> bool:
    """A 2-D convolution reading its data and weight in channel blocks (a depthwise conv after
    conv_layout.py): it vectorizes over channels, so where its output positions are stored does not matter
    to its vectors."""
    if (not isinstance(op, te.ComputeOp) or len(op.axis) != 4 or len(op.body) != 1 or op.num_outputs != 1
            or not isinstance(op.body[0], tvm.tirx.Reduce)):
        return False
    loads = tensor_loads(op.body[0])
    return len(loads) == 2 and all(len(ld.args) == 6 for ld in loads)


def _flat(op, mapping) -> te.ComputeOp:
    """`op` computed over [N, C, H * W]: its body at (n, c, p // W, p % W), reading flattened tensors flat."""
    n, c, h, w = (int(d) for d in op.output(0).shape)
    handles = [iv.var.__chandle__() for iv in op.axis]
    body = map_loads(op.body[0], read_through(mapping))

    def flat(i, ch, p):
        value = substitute(body, dict(zip(handles, (i, ch, p // w, p % w))))
        return simplify_reads(value, {i: n, ch: c, p: h * w})
    return te.compute((n, c, h * w), flat, name=f"{op.name}_flat", tag=op.tag).op


def _as_gemm(op, data, weight, mapping) -> te.ComputeOp:
    """The 1x1 convolution `op` as out[n, f, p] = sum_k X[n, k, p] * W[f // B, k, 0, 0, f % B]."""
    n, f, h, w = (int(d) for d in op.output(0).shape)
    x = data.args[0]
    channels = int(x.shape[1])
    flat_x = mapping[tensor_key(x)]
    weight_read = map_loads(weight, read_through(mapping))
    k = te.reduce_axis((0, channels), name="k")

    def gemm(i, fo, p):
        subst = {iv.var.__chandle__(): tvm.tirx.IntImm("int32", 0) for iv in op.reduce_axis}  # the 1x1 taps
        subst[data.args[2].__chandle__()] = k.var  # the input channel
        subst[op.axis[1].var.__chandle__()] = fo
        return te.sum(flat_x(i, k, p // w, p % w) * substitute(weight_read, subst), axis=k)

    def simplified(i, fo, p):
        return simplify_reads(gemm(i, fo, p), {i: n, fo: f, p: h * w})
    return te.compute((n, f, h * w), simplified, name=f"{op.name}_gemm", tag=op.tag).op
