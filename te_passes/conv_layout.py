"""Convolution layouts for the CPU's channel-vectorized conv schedule, chosen at compile time.

1. Depthwise convolutions read their input in channel blocks: X[N, C, H, W] becomes Xc[N, C / B, H, W, B].

A depthwise convolution has no reduction over channels, so the only axis along which a vector of B output
points shares its weights' layout is the channel axis (block_conv_weights stores the weight as [C / B, 1, kh,
kw, B], conv_weights.py). In NCHW the B channels of one input point lie H * W floats apart: a vector over
channels gathers, and a vector over the output width gathers too once the stride is 2 (or is a ragged 14 lanes
for 56 or 28 columns). With the input in channel blocks every tap of every vector is one contiguous load,
whatever the stride: this is the NCHWc layout of TVM's x86 conv schedules and ONNX Runtime's MLAS, applied
where it pays most. The blocked copy costs nothing extra: the padded input is a copy already, and its producer
(the pad, with batch norm and activation composed into it by the vertical pass) is rewritten to store in
blocks.
Values are unchanged; only where an intermediate tensor lives changes. When that pad reads a dense
convolution it alone reads (EfficientNet's 1x1 expand conv), the convolution stores its output in channel
blocks too: its register tile is then written back as whole vectors, not transposed into NCHW.

2. Dense convolutions read constant weights in wider output-channel blocks ([F / 32, C, kh, kw, 32] instead
of the frontend's 16): the schedule's register tile then spans two vectors of output channels by 7 columns,
so each input value broadcast feeds two FMAs (1x1 convs of ResNeXt: 1.3-1.6x faster than 16 x 14 tiles),
as for the GEMM's 8 x 32 tile.
"""

from __future__ import annotations

import logging

import tvm
import tvm_ffi
from tvm import te

import numpy as np

from souffle_py.ir.program import TEProgram
from souffle_py.ir.exprs import simplify_reads, substitute, uses
from te_passes.channel_padding import ChannelPadding, padded_size
from souffle_py.ir.analysis.body import is_read
from souffle_py.ir.graph import map_loads, rebuild, rebuild_reading, sweep, tensor_key, tensor_loads, with_reduce_source
from te_passes.patterns import (LAYOUT_RANKS, conv, conv2d, data_reads_output_channel, has_rank, in_layout, is_map,
                                product_reduction)
from souffle_py.ir.marks import member_of

log = logging.getLogger(__name__)


def block_depthwise_inputs(program: TEProgram, block: int) -> TEProgram:
    """`program` with each depthwise 2-D convolution (C channels, a multiple of `block`) reading its input
    from a [N, C / block, H, W, block] tensor; the input's producer is rewritten to store in that layout
    when the convolution is its only reader and it is elementwise (a pad), else a blocked copy is added."""
    consumers = program.consumers()
    new_of: dict[tuple, object] = {}
    original: dict[tuple, te.Operation] = {}  # rebuilt tensor -> the program's op it replaces
    convs_blocked: dict[tuple, te.Tensor | None] = {}  # one blocked conv however often the pad reads it

    def conv_reads(t):
        if tensor_key(t) not in convs_blocked:
            readers = consumers.get(original.get(tensor_key(t), t.op), [])
            convs_blocked[tensor_key(t)] = _conv_in_blocks(program, readers, t, block)
        return convs_blocked[tensor_key(t)]

    changed = False
    for op in program.stages:
        found = _depthwise_input(op, block)
        mapping = dict(new_of)
        if found is not None:
            load, channel = found
            source = new_of.get(tensor_key(load.args[0]), load.args[0])
            only_reader = len(consumers.get(load.args[0].op, [])) == 1 and load.args[0].op not in \
                [t.op for t in program.outputs.values()]
            blocked = _blocked(source, block, compose=only_reader, conv_reads=conv_reads,
                               inlinable=lambda t, pad=load.args[0].op: _only_elementwise_reader(
                                   program, consumers, original.get(tensor_key(t), t.op), pad))
            mapping[tensor_key(load.args[0])] = (
                lambda n, c, h, w, xb=blocked, ch=channel: xb[n, ch // block, h, w, ch % block])
            changed = True
        if any(tensor_key(t) in mapping for t in op.input_tensors):
            new = rebuild(op, mapping)
            for i in range(op.num_outputs):
                new_of[tensor_key(op.output(i))] = new.output(i)
                original[tensor_key(new.output(i))] = op
    if not changed:
        return program
    outputs = {name: new_of.get(tensor_key(t), t) for name, t in program.outputs.items()}
    return program.replace(outputs=outputs)


def separate_depthwise_operands(program: TEProgram) -> TEProgram:
    """`program` with the input operand of each depthwise convolution that the vertical pass composed (a
    strided conv reads each input element few times: its pad, batch norm and clip are evaluated inside the
    product) computed as a TE of its own over the padded input, P[n, c, h, w], which the conv reads at
    [n, f, y * sy + r, x * sx + s]. Runs after channel_blocks.py, which keeps such a conv composed where it
    can store the conv's producer in blocks (no padded copy at all); what it leaves in NCHW runs as a
    scalar reduction (MobileNetV2's stride-2 depthwise convs: 5 GFLOP/s). Separated, P is the padded copy
    that block_depthwise_inputs stores in channel blocks, as for the stride-1 convs. Values unchanged."""
    def rewrite(op, reads):
        op = rebuild_reading(op, reads, {})
        found = _composed_depthwise_operand(op)
        if found is None:
            return None
        operand, padded = found
        source = op.body[0].source[0]
        product = tvm.tirx.Mul(padded, source.b) if source.a.same_as(operand) else tvm.tirx.Mul(source.a, padded)
        log.info("depthwise %s: its composed input operand is a TE of its own", op.name)
        return with_reduce_source(op, product)

    new_of, replaced = sweep(program.stages, rewrite)
    return program.rebuilt(new_of) if replaced else program


def _composed_depthwise_operand(op):
    """(the operand expression, a load of a new TE P computing it over the padded input) when `op` is a
    depthwise 2-D convolution sum E * W[f // B, 0, r, s, f % B] whose E is not a single load but an
    elementwise function of loads X[n, f, y * sy + r + o, x * sx + s + o'] (unit dilation); else None."""
    product = product_reduction(op)
    if product is None or not is_map(op) or member_of(op) is not None or len(op.reduce_axis) != 3:
        return None
    weights = [x for x in (product.a, product.b) if is_read(x) and in_layout(x, "OIHWo")]
    if len(weights) != 1 or int(weights[0].args[0].shape[1]) != 1:
        return None
    operand = product.b if product.a.same_as(weights[0]) else product.a
    n, f, y, x = (iv.var for iv in op.axis)
    rc, r, s = (iv.var for iv in op.reduce_axis)
    loads = [ld for ld in tensor_loads(operand) if any(uses(i, v) for i in ld.args[1:] for v in (y, x, r, s))]
    if (is_read(operand) or not loads or int(op.reduce_axis[0].dom.extent) != 1
            or any(not in_layout(ld, "NCHW") or not ld.args[2].same_as(f) for ld in loads)):
        return None  # a plain read, or not a map read channel by channel (per-channel constants may join)
    analyzer = tvm.sym.Analyzer()
    zero = tvm.tirx.IntImm("int32", 0)

    def step(index, var, other):  # d index / d var, with the other loop variables at 0
        def at(v):
            return analyzer.simplify(substitute(index, {var.__chandle__(): tvm.tirx.IntImm("int32", v),
                                                        other.__chandle__(): zero, rc.__chandle__(): zero}))
        delta = analyzer.simplify(at(1) - at(0))
        return int(delta) if isinstance(delta, tvm.tirx.IntImm) else None
    strides = {(step(ld.args[3], y, r), step(ld.args[3], r, y), step(ld.args[4], x, s), step(ld.args[4], s, x))
               for ld in loads}
    if len(strides) != 1:
        return None
    sy, dy, sx, dx = strides.pop()
    if None in (sy, sx) or dy != 1 or dx != 1 or sy < 1 or sx < 1:
        return None
    h, w = te.var("h"), te.var("w")
    # E over the padded input: y = 0 and r = h (x = 0, s = w) where E reads y * sy + r; checked below
    inner = substitute(operand, {y.__chandle__(): zero, r.__chandle__(): h, x.__chandle__(): zero,
                                 s.__chandle__(): w, rc.__chandle__(): zero})
    back = substitute(inner, {h.__chandle__(): y * sy + r, w.__chandle__(): x * sx + s})
    if not tvm_ffi.structural_equal(analyzer.canonical_simplify(simplify_reads(back, {})),
                                   analyzer.canonical_simplify(simplify_reads(substitute(
                                       operand, {rc.__chandle__(): zero}), {}))):
        return None
    shape = (int(op.axis[0].dom.extent), int(op.axis[1].dom.extent),
             (int(op.axis[2].dom.extent) - 1) * sy + int(op.reduce_axis[1].dom.extent),
             (int(op.axis[3].dom.extent) - 1) * sx + int(op.reduce_axis[2].dom.extent))
    handles = (n.__chandle__(), f.__chandle__(), h.__chandle__(), w.__chandle__())
    padded = te.compute(shape, lambda *i: substitute(inner, dict(zip(handles, i))), name=f"{op.name}_input")
    return operand, padded(n, f, y * sy + r, x * sx + s)


def widen_weight_blocks(program: TEProgram, block: int) -> TEProgram:
    """`program` with each dense convolution's constant weight [F / b, C, *k, b] (b < `block`, F a multiple
    of `block`) re-blocked as [F / block, C, *k, block]; grouped and depthwise convolutions keep theirs."""
    params, param_tensors = dict(program.params), dict(program.param_tensors)
    widened: dict[str, te.Tensor] = {}
    new_of: dict[tuple, object] = {}
    for op in program.stages:
        weight = _dense_conv_weight(program, op, block)
        mapping = dict(new_of)
        if weight is not None:
            name = weight.op.name
            if name not in widened:
                value = params[name]
                plain = value.transpose(0, value.ndim - 1, *range(1, value.ndim - 1)).reshape(-1, *value.shape[1:-1])
                wide = plain.reshape(plain.shape[0] // block, block, *plain.shape[1:])
                new_name = f"{name}_x{block}"
                params[new_name] = np.ascontiguousarray(wide.transpose(0, *range(2, wide.ndim), 1))
                param_tensors[new_name] = widened[name] = te.placeholder(params[new_name].shape, str(value.dtype),
                                                                         name=new_name)
            old_block, wide_t = int(weight.shape[-1]), widened[name]
            simplify = tvm.sym.Analyzer().canonical_simplify

            def read(fo, *rest, wt=wide_t, b=old_block):
                f = simplify(fo * b + rest[-1])
                return wt[(simplify(f // block), *rest[:-1], simplify(f % block))]
            mapping[tensor_key(weight)] = read
        if any(tensor_key(t) in mapping for t in op.input_tensors):
            new = rebuild(op, mapping)
            for i in range(op.num_outputs):
                new_of[tensor_key(op.output(i))] = new.output(i)
    if not widened:
        return program
    outputs = {name: new_of.get(tensor_key(t), t) for name, t in program.outputs.items()}
    read = {t.op.name for op in program.replace(outputs=outputs).stages for t in op.input_tensors}
    params = {n: v for n, v in params.items() if n in read}
    return program.replace(outputs=outputs, params=params, param_tensors={n: param_tensors[n] for n in params})


def _dense_conv_weight(program: TEProgram, op, block: int) -> te.Tensor | None:
    """The constant blocked weight W[f // b, c, r, s, f % b] of a dense 2-D convolution `op` when b < block
    and F is a multiple of block (it can be widened to `block`); else None."""
    w = _conv_weight(program, op)
    if w is None:
        return None
    b, filters = int(w.shape[-1]), int(w.shape[0]) * int(w.shape[-1])
    return w if b < block and filters % block == 0 else None


def _conv_weight(program: TEProgram, op) -> te.Tensor | None:
    """The constant blocked weight W[f // b, c, r, s, f % b] of a dense 2-D convolution `op` (its channel
    reduction covers all input channels); else None."""
    found = conv2d(op)
    if found is None:
        return None
    w = found.weight_tensor
    if (not isinstance(w.op, te.PlaceholderOp) or program.placeholder_kind(w) != "param" or str(w.dtype) != "float32"
            or not _reads_a_channel_range(found.data, found.weight)):
        return None
    return w


def _reads_a_channel_range(data, weight) -> bool:
    """Whether a conv reads input channel c + k for its weight's channel c, k constant, within the map: all
    of it (k = 0, C channels), or a contiguous slice of a wider map (GoogLeNet's 3x3 branch convs read their
    share of the pad that horizontal.py stacked for two branches). A grouped conv's offset depends on the
    output channel."""
    x, w, channel = data.args[0], weight.args[0], weight.args[2]
    analyzer = tvm.sym.Analyzer()
    # NCHW; else, where the weight's channel is a reduction variable (not a depthwise conv's 0), the axis that
    # reads it: channels-last, where a layer norm over channels, its transposes folded, feeds the conv
    # (CoAtNet's 1x1 convs over [1, 7, 7, 512])
    others = [] if isinstance(channel, tvm.tirx.IntImm) else [a for a in range(len(x.shape)) if a != 1]
    for axis in [1, *others]:
        offset = analyzer.simplify(data.args[axis + 1] - channel)
        if isinstance(offset, tvm.tirx.IntImm):
            return offset.value >= 0 and offset.value + int(w.shape[1]) <= int(x.shape[axis])
    return False


def _depthwise_input(op: te.ComputeOp, block: int):
    """(the input load, its channel index as the output-channel variable) when `op` is a depthwise 2-D
    convolution out[n, f, y, x] = sum X[n, f, ..] * W[f // B, 0, r, s, f % B] over C channels, a multiple of
    `block`; else None (and why, logged)."""
    found = conv2d(op)  # X[n, c, y, x] * W[f // B, c, r, s, f % B]
    if found is None or not isinstance(found.data_tensor.op, (te.ComputeOp, te.PlaceholderOp)):
        return None
    x = found.data_tensor
    if not found.depthwise:
        return None  # grouped or dense: its channel reduction reads contiguous NCHW rows
    channels = found.channels
    if channels % block or str(x.dtype) != "float32":
        log.info("depthwise %s keeps NCHW: %d channels are not a multiple of %d", op.name, channels, block)
        return None
    unit = {iv.var.__chandle__(): tvm.tirx.IntImm("int32", 0) for iv in op.reduce_axis if int(iv.dom.extent) == 1}
    f = op.axis[1].var
    channel = tvm.sym.Analyzer().simplify(substitute(found.data.args[2], unit))
    if not channel.same_as(f) and not tvm_ffi.structural_equal(channel, f):
        log.info("depthwise %s keeps NCHW: its input channel %s is not the output channel", op.name, channel)
        return None
    return found.data, f


def _blocked(x: te.Tensor, block: int, compose: bool, conv_reads=lambda t: None,
             inlinable=lambda t: False) -> te.Tensor:
    """x[N, C, H, W] stored as [N, C / block, H, W, block]: x's own elementwise body evaluated in the new
    layout when `compose` (x then has no other reader), else a copy. In a composed body, reads of the
    elementwise tensors `inlinable` accepts are replaced by their bodies, and a read of a tensor for which
    `conv_reads` gives a channel-blocked version (a dense conv's output) reads that."""
    n, c, h, w = (int(d) for d in x.shape)
    shape = (n, c // block, h, w, block)
    op = x.op
    if compose and isinstance(op, te.ComputeOp) and not op.reduce_axis and op.num_outputs == 1:
        handles = [iv.var.__chandle__() for iv in op.axis]
        body = _read_blocked_convs(_inline(op.body[0], inlinable), op.axis[1].var, conv_reads)

        def composed(i, cb, y, xx, ci):
            value = substitute(body, dict(zip(handles, (i, cb * block + ci, y, xx))))
            return simplify_reads(value, {cb: c // block, ci: block, y: h, xx: w, i: n})
        return te.compute(shape, composed, name=f"{op.name}_c{block}", tag=op.tag)
    return te.compute(shape, lambda i, cb, y, xx, ci: x[i, cb * block + ci, y, xx], name=f"{op.name}_c{block}")


def _only_elementwise_reader(program: TEProgram, consumers, op, pad) -> bool:
    """Whether `op` is an elementwise 4-D TE (no reduction) that `pad` alone reads: its body can move into
    the blocked pad. The vertical pass keeps BN + SiLU out of a pad that grows the map by more than its
    recompute budget allows (5x5 kernels on 14 x 14 maps: 18 x 18 / 14 x 14 = 1.65 evaluations per
    element), but stored on its own it is one more pass over the map, in scalars where the rows are not
    a multiple of 4 (14, 7); composed it runs over channel vectors in the pad's pass."""
    return (is_map(op) and not op.reduce_axis and op.num_outputs == 1
            and member_of(op) is None and all(not o.op.same_as(op) for o in program.outputs.values())
            and len(consumers.get(op, [])) == 1 and consumers[op][0].same_as(pad))


def _inline(body, inlinable):
    """`body` with each read of a tensor `inlinable` accepts replaced by that tensor's body at the indices."""
    def visit(tensor, indices):
        if not inlinable(tensor):
            return None
        handles = [iv.var.__chandle__() for iv in tensor.op.axis]
        return substitute(tensor.op.body[0], dict(zip(handles, indices)))
    return map_loads(body, visit)


def _read_blocked_convs(body, channel, conv_reads):
    """`body` reading T[n, c, h, w] (c the channel variable) as Tb[n, c // b, h, w, c % b] wherever
    conv_reads(T) gives the blocked Tb."""
    def rewrite(tensor, indices):
        if len(indices) != LAYOUT_RANKS["NCHW"] or not indices[1].same_as(channel):
            return None
        blocked = conv_reads(tensor)
        if blocked is None:
            return None
        b = int(blocked.shape[-1])
        return blocked[indices[0], indices[1] // b, indices[2], indices[3], indices[1] % b]
    return map_loads(body, rewrite)


def _conv_in_blocks(program: TEProgram, readers: list, t: te.Tensor, block: int) -> te.Tensor | None:
    """A dense convolution's output t[N, F, H, W] computed as [N, F / b, H, W, b], b its weight's output-
    channel block (a multiple of `block`), when the blocked pad being built is its only one of `readers`;
    None otherwise. Its register tile (b channels by a row of columns) is then written back as whole
    vectors, not transposed into NCHW element by element, and the pad reads contiguous channels."""
    op = t.op
    weight = _conv_weight(program, op)
    if (weight is None or len(readers) != 1 or any(o.op.same_as(op) for o in program.outputs.values())
            or int(weight.shape[-1]) % block):
        return None
    b = int(weight.shape[-1])
    n, f, h, w = (int(d) for d in t.shape)
    handles = [iv.var.__chandle__() for iv in op.axis]
    body = op.body[0]

    def blocked(i, fb, y, xx, fi):
        value = substitute(body, dict(zip(handles, (i, fb * b + fi, y, xx))))
        return simplify_reads(value, {i: n, fb: f // b, y: h, xx: w, fi: b})
    return te.compute((n, f // b, h, w, b), blocked, name=f"{op.name}_c{b}", tag=op.tag)


def pad_filters(program: TEProgram, block: int, vector: int) -> TEProgram:
    """`program` with each dense convolution whose F output channels no vector divides (ShuffleNet's 58 and
    116 where the channel-blocked network stops at its channel shuffle: a 4-lane tile over the map's
    columns, 4-6 GFLOP/s) computed over F padded to a multiple of `block`, from a zero-padded weight
    (channel_padding.py): its register tile then runs whole vectors of filters. Readers read the first F
    channels of the padded map; a program output keeps its shape. Convs that horizontal.py stacked over
    their first axis, each reading its own input with its own weight [B, F / b, C', kh, kw, b] (Res2Net's
    3x3 convs over the splits of a block: 3 x 52 filters, 4-lane tiles at 54 GFLOP/s), pad each branch's."""
    outputs = {tensor_key(t) for t in program.outputs.values()}
    padding = ChannelPadding(program)

    def rewrite(op, reads):
        weight = _filter_weight(program, op)
        if weight is None or tensor_key(op.output(0)) in outputs:
            return None
        n, filters, h, w = (int(d) for d in op.output(0).shape)
        if filters % vector == 0 or filters < vector:
            return None
        size = padded_size(filters, block) if padded_size(filters, block) == padded_size(filters, vector) else \
            padded_size(filters, vector)  # the wider block only where it pads no more (58 -> 64, not 40 -> 64)
        unit = block if size % block == 0 else vector
        stacked = has_rank(weight, "GOIHWo")  # [B, F / b, C', kh, kw, b]: the branch is the output's first axis
        wide, b = padding.padded_weight(weight, unit, stacked), int(weight.shape[-1])
        handles = [iv.var.__chandle__() for iv in op.axis]

        def read(tensor, indices):
            if tensor_key(tensor) == tensor_key(weight):
                branch, (fo, *middle, fi) = indices[:stacked], indices[stacked:]
                f = fo * b + fi
                return wide[(*branch, f // unit, *middle, f % unit)]
            new = reads.get(tensor_key(tensor))
            return None if new is None else new(*indices)

        def padded(i, f, y, x):
            value = map_loads(substitute(op.body[0], dict(zip(handles, (i, f, y, x)))), read)
            return simplify_reads(value, {i: n, f: size, y: h, x: w})
        new = te.compute((n, size, h, w), padded, name=f"{op.name}_p{unit}", tag=op.tag)
        log.debug("%s: %d filters computed as %d", op.name, filters, size)
        return new.op, lambda *indices: new(*indices)

    new_of, replaced = sweep(program.stages, rewrite)
    if not replaced:
        return program
    return program.rebuilt(new_of, padding.params, padding.param_tensors)


def _filter_weight(program: TEProgram, op) -> te.Tensor | None:
    """The constant blocked weight [F / b, C', kh, kw, b] of a 2-D convolution `op` with an NCHW output of F
    channels, whatever its input's layout (NCHW or channel blocks); else None."""
    found = conv(op)
    if found is None or found.spatial != 2 or not is_map(op) or member_of(op) is not None:
        return None
    w = found.weight_tensor
    if (not isinstance(w.op, te.PlaceholderOp) or program.placeholder_kind(w) != "param"
            or not _per_filter_read(found) or str(w.dtype) != "float32"):
        return None
    if found.filters != int(op.output(0).shape[1]):  # F / b blocks of b
        return None
    # dense only: a depthwise or grouped conv reads its input at channels that follow the filter, which
    # padded filters would read past the input's channels
    return None if data_reads_output_channel(found) else w


def _per_filter_read(found) -> bool:
    """Whether a convolution reads its weight per filter: unstacked, or stacked [B, F / b, C', kh, kw, b]
    and read at the branch that is the output's first axis."""
    if not found.stacked:
        return True
    op = found.op
    return found.weight.args[1].same_as(op.axis[0].var) and int(found.weight_tensor.shape[0]) == int(op.axis[0].dom.extent)
