"""Convolution networks carried in channel blocks from conv to conv (CPU backend): NCHW -> NCHW[b]c.

A dense convolution's register tile is b output channels (one or two vectors, the weight's block,
conv_layout.py) by a row of output columns. Over an NCHW input each reduction step broadcasts one input
value per column from a different row of the map: the C input channels of one tile lie H * W floats apart,
so the tile's input (C x 7 floats) is spread over C cache lines that L1 cannot keep for the next block of
output channels once C is large, and its NCHW output is transposed element by element. With every map
between the convolutions stored as [N, C / b, H, W, b] (the NCHWc layout of ONNX Runtime's MLAS and TVM's
x86 conv schedules) the tile's input is one contiguous run and its output whole vectors (a 256 -> 256 1x1
conv at 56 x 56: 101 -> 154 GFLOP/s here; 512 -> 512 at 28 x 28: 112 -> 152).

The layout is carried through whatever lies between the convolutions, so that no copy converts it: pads
with batch norm and activation composed in, residual adds, pools; each of those reads its inputs at its
own channel, so in blocks its vectors run along the channel lanes. A tensor is stored in blocks only when
every reader can read it so (another blocked TE, a convolution, or a global pool, which reduces one
channel per lane) and, for a TE that is not a convolution, when every full-size map it reads is blocked
too: anything else would gather across blocks. Model inputs and outputs keep their layout. Values are
unchanged; only where intermediate tensors live changes. Runs after the other layout passes, whose 5-D
tensors it leaves alone; the depthwise layouts of conv_layout.py and depthwise_blocks.py run after it,
for depthwise convs left outside its networks.
"""

from __future__ import annotations

import logging
import math

import tvm
import tvm_ffi
from tvm import te

from souffle_py.ir.program import TEProgram
from te_passes.channel_padding import ChannelPadding, padded_body, padded_size
from souffle_py.ir.exprs import simplify_reads, substitute
from souffle_py.ir.graph import map_loads, read_through, sweep, tensor_key, tensor_loads
from te_passes.patterns import conv, conv2d, has_rank, in_layout, is_map
from souffle_py.ir.marks import member_of

log = logging.getLogger(__name__)
IF_THEN_ELSE = tvm.ir.Op.get("prim.if_then_else")

# An elementwise reader outside the blocks (a model output, an op reading a map kept in NCHW) reads the
# blocked map through its blocks, T[n, c // b, y, x, c % b]: the reorder back to NCHW happens in that
# reader's own pass instead of the producer's register tile being transposed into NCHW element by element
# and the whole network before it abandoning blocks (a 1x1 conv over 104 channels whose ReLU is the model
# output: 0.087 -> X ms). Readers that reduce would gather inside their reduction loop: they keep the rule.
REORDER_IN_READERS = True
PAD_CHANNELS = True  # channel counts the block does not divide are padded (channel_padding.py)
PAD_TOLERANCE = 0.05  # extra padded work (a share of the convolutions') worth two-vector channel blocks


def block_conv_networks(program: TEProgram, block: int) -> TEProgram:
    """`program` with the 4-D maps of its convolution networks stored as [N, ceil(C / b), H, W, b],
    wherever every reader and every full-size input allows it (module docstring); unchanged when no
    convolution qualifies. b is `block` or half of it, whichever pads the convolutions' work less, chosen
    for each component of maps read in lanes (`_component_blocks`), a TE that gathers in its component's
    block left out; channel counts that b does not divide are padded (channel_padding.py)."""
    consumers = program.consumers()
    outputs = {t.op for t in program.outputs.values()}
    widest, block = block, network_block(program, block)
    chosen = {op for op in program.stages if _blockable(op, block, outputs, program)}
    half_or_double = _other_size(block, widest)
    other = {op for op in program.stages if op not in chosen and _blockable(op, half_or_double, outputs, program)}
    for op in program.stages:
        if op not in chosen | other and is_map(op) and blocked_conv_weight(op) is not None:
            log.info("%s keeps its layout: %s channels (blocks need more than one point, outside model "
                     "outputs, a constant weight or weight blocks dividing or divided by %d, groups that pad "
                     "inside their input)", op.name, op.output(0).shape[1], block)
    if not any(blocked_conv_weight(op) is not None for op in chosen | other):
        return program
    # why a TE blockable only in the other size stays out is logged at debug level (transformers' attention
    # maps over 12 heads pad to 16, and each would say it)
    say = {op: log.info for op in chosen} | {op: log.debug for op in other}
    chosen |= other
    while True:
        while True:  # drop what a reader or an input outside the set would have to gather
            dropped = {op: why for op in chosen if (why := _misfit(op, chosen, consumers, block))}
            if not dropped:
                break
            chosen -= set(dropped)
            for op, why in dropped.items():
                say[op]("%s keeps its layout: %s", op.name, why)
        blocks = _component_blocks(program, chosen, consumers, block, widest)
        # a member whose lanes gather under its component's block (a concat at an offset of 16 in a
        # component that other members hold to 32) leaves the set, and the rest is decided again
        unfit = {op for op in chosen if not _blockable(op, blocks[op], outputs, program)}
        if not unfit:
            break
        chosen -= unfit
        for op in unfit:
            say[op]("%s keeps its layout: its channel lanes would gather in blocks of %d", op.name, blocks[op])
    convs = sum(1 for op in chosen if blocked_conv_weight(op) is not None)
    if not convs:
        return program
    padding = ChannelPadding(program)
    blocked_keys = {tensor_key(op.output(0)) for op in chosen}

    def rewrite(op, reads):
        if op not in chosen:
            return None
        b = blocks[op]
        new = in_blocks(op, b, reads, padding, blocked_keys)
        return new.op, lambda n, c, y, x, t=new, b=b: t[n, c // b, y, x, c % b]

    new_of, _ = sweep(program.stages, rewrite)
    padded = sum(1 for op in chosen if int(op.output(0).shape[1]) % blocks[op])
    log.info("%d convolutions and %d other TEs store channel blocks of %s (%d padded)", convs,
             len(chosen) - convs, "/".join(str(b) for b in sorted(set(blocks.values()))), padded)
    return program.rebuilt(new_of, padding.params, padding.param_tensors)


def _component_blocks(program, chosen, consumers, block: int, widest: int) -> dict:
    """The block of each chosen TE. Maps that one TE reads in channel lanes (an elementwise op's, a pool's
    or a depthwise conv's input) share a block, but a dense conv broadcasts its input one channel at a time,
    whatever block the input has, so the networks' maps fall into components that each choose, as
    `network_block` chooses for the whole program, between two vectors and one (DLA-34: its 16-channel
    stem at 224 x 224 wants blocks of 16, its 256-channel convs at 14 x 14 two vectors). A component keeps
    `block` where the other does not fit all its members, and takes the other where its own would leave a
    pool out (`_strands_a_pool`)."""
    parent = {op: op for op in chosen}

    def root(op):
        while parent[op] is not op:
            parent[op] = parent[parent[op]]
            op = parent[op]
        return op
    for op in chosen:
        weight = blocked_conv_weight(op)
        for load in tensor_loads(op.body[0]):
            t = load.args[0]
            if not in_layout(load, "NCHW") or t.op not in parent:
                continue
            # a dense conv reads any block; a grouped one reads its padded input lanes (its groups past C)
            if weight is not None and int(weight.shape[-4]) == int(t.shape[1]) and _lane_step(
                    load.args[2], op.axis[1].var, block) == "invariant":
                continue
            parent[root(op)] = root(t.op)
    members = {}
    for op in chosen:
        members.setdefault(root(op), []).append(op)
    outputs = {t.op for t in program.outputs.values()}
    blocks = {}
    for group in members.values():
        def fits(b, group=group):
            return all(_blockable(op, b, outputs, program) and _lanes_fit(op, b)
                       and not _misfit(op, chosen, consumers, b) for op in group)
        wanted = _cheaper_block([op for op in group if blocked_conv_weight(op) is not None], widest)
        if wanted != block and not fits(wanted):
            wanted = block
        other = _other_size(wanted, widest)
        if _strands_a_pool(group, wanted, consumers, outputs, program) and fits(other):
            wanted = other
        blocks.update((op, wanted) for op in group)
    return blocks


def _strands_a_pool(group, block: int, consumers, outputs, program) -> bool:
    """Whether members that gather in blocks of `block` (a concat whose parts start off the block: GoogLeNet's
    112 + 288 + 64 + 64 channels in blocks of 32) would take a pool reading them out of the blocks with them:
    a pool over an NCHW map reduces one element per step (GoogLeNet's 3x3 max pool over that concat, 0.09 ms
    against 0.03 in blocks), while an elementwise copy still runs in vectors along its rows and a dense conv
    reads any layout (Inception-v3's pads read at an offset of 112 stay in NCHW: its convs in two-vector
    blocks are 2% faster than in blocks of 16)."""
    members = set(group)
    lost = [op for op in group if not _blockable(op, block, outputs, program)]
    seen = set(lost)
    while lost:
        op = lost.pop()
        if op.reduce_axis and blocked_conv_weight(op) is None:
            return True
        for reader in consumers.get(op, []):
            if reader in members and reader not in seen and blocked_conv_weight(reader) is None:
                seen.add(reader)
                lost.append(reader)
    return False


def _lanes_fit(op, block: int) -> bool:
    """Whether a conv's vector of `block` output channels reads its input without a gather: one broadcast
    input channel (a dense conv, or a group at least `block` wide) or the output's own channels (a
    depthwise conv). RegNet's 16-channel groups under 32 lanes read two groups' inputs per vector (5
    GFLOP/s against 260 in blocks of 16). Other TEs: `_gathers_channels`."""
    if blocked_conv_weight(op) is None:
        return True
    data = _data_load(op)
    single = {r.var.__chandle__(): tvm.tirx.const(0, "int32") for r in op.reduce_axis if int(r.dom.extent) == 1}
    return _lane_step(substitute(data.args[2], single), op.axis[1].var, block) != "gather"  # a depthwise f + rc


def network_block(program: TEProgram, widest: int) -> int:
    """`widest` (two vectors: the dense conv's two-vector register tile) unless padding the convolutions'
    output channels to it costs more than PAD_TOLERANCE of their work above what half of it costs (RegNet's
    104 channels: 128 / 104 against 112 / 104); then half."""
    return _cheaper_block([op for op in program.stages if blocked_conv_weight(op) is not None], widest)


def _cheaper_block(convs, widest: int) -> int:
    """`network_block`'s choice over the convolutions `convs`."""
    work = {widest: 0, widest // 2: 0}
    total = 0
    for op in convs:
        if not is_map(op):
            continue
        channels = int(op.output(0).shape[1])
        points = math.prod(int(d) for d in op.output(0).shape) // channels
        points *= math.prod(int(r.dom.extent) for r in op.reduce_axis)
        total += channels * points
        for b in work:
            work[b] += padded_size(channels, b) * points
    if not total:
        return widest
    return widest if work[widest] <= work[widest // 2] + PAD_TOLERANCE * total else widest // 2


def _blockable(op, block: int, outputs, program) -> bool:
    """A 4-D float32 map over more than one point, outside recurrences and program outputs, whose channel
    axis is not reduced: a convolution whose weight blocks divide `block` (or are blocked by it) or, where
    C is padded, whose weight is a constant (re-blocked with zero filters) and whose groups read inside
    their input's padded blocks; or an elementwise TE or per-channel reduction (pad, pool) whose vector
    of channel lanes reads no other tensor element by element (`_gathers_channels`)."""
    if (not is_map(op) or op.num_outputs != 1 or op in outputs
            or member_of(op) is not None or str(op.output(0).dtype) != "float32"):
        return False
    shape = [int(d) for d in op.output(0).shape]
    if shape[2:] == [1, 1] or padded_size(shape[1], block) > 2 * shape[1] or (shape[1] % block and not PAD_CHANNELS):
        return False  # a point per channel, or more padding than channels (an RGB input's pad)
    weight = blocked_conv_weight(op)
    if weight is not None:
        if shape[1] % block == 0:
            return block % int(weight.shape[-1]) == 0 or int(weight.shape[-1]) % block == 0
        load = _data_load(op)
        group_channels, channels = int(weight.shape[1]), int(load.args[0].shape[1])
        # a dense conv's input channel does not depend on its filter (it may read a slice of a stacked input:
        # GoogLeNet's 96 of 112); a group's input channels f // Cg * Cg + rc stay below the padded C where
        # C == F and Cg divides it
        dense_or_even = _lane_step(load.args[2], op.axis[1].var, block) == "invariant" or (
            channels == shape[1] and padded_size(shape[1], block) % group_channels == 0)
        return (has_rank(weight, "OIHWo") and program.placeholder_kind(weight) == "param" and dense_or_even)
    return (not op.reduce_axis or _reduces_per_channel(op)) and not _gathers_channels(op, block)


def _gathers_channels(op, block: int) -> bool:
    """Whether a vector of `block` channel lanes of `op` would gather: a 4-D map read with the channel in
    another index than its channel axis or shifted off the block boundary (a concat of 120 + 120 channels
    reads its second part at c - 120: lane l of a block is lane l + 8 of another), or another tensor read
    neither at one element nor contiguously along its last axis, unless `op` is elementwise and reads some
    map in lanes (in NCHW it would gather that one instead: a residual add of a blocked map and a flat
    GEMM's output). Attention after a conv stem is 4-D too, [N, heads, tokens, d], and a per-head GEMM
    reading V[k, head * d + x] in head lanes loads 16 floats d apart (LeViT's P.V: 3 GFLOP/s, a third of
    the model); left in its layout it vectorizes along x."""
    channel = op.axis[1].var
    in_lanes, gathers = False, False
    for load in tensor_loads(op.body[0]):
        tensor, steps = load.args[0], [_lane_step(i, channel, block) for i in load.args[1:]]
        if not steps:  # a 0-d tensor (a quantization scale): one element for every lane
            continue
        if in_layout(load, "NCHW") and str(tensor.dtype) == "float32":  # a map: blocked, or _misfit drops op
            if steps[0] != "invariant" or steps[2:] != ["invariant"] * 2 or steps[1] == "gather":
                return True
            in_lanes |= steps[1] == "aligned"
            continue
        shape = [int(d) for d in tensor.shape]
        last = max((i for i, d in enumerate(shape) if d != 1), default=len(steps) - 1)
        gathers |= any(s != "invariant" for i, s in enumerate(steps) if i != last) or steps[last] == "gather"
        in_lanes |= has_rank(tensor, "NCHWc") and steps[last] == "aligned" and all(  # a map in blocks already
            s == "invariant" for i, s in enumerate(steps) if i != last)
    return gathers and (bool(op.reduce_axis) or not in_lanes)


def _lane_step(index, channel, block: int) -> str:
    """How `index` moves over a block of channel lanes c = outer * block + lane: 'invariant', 'aligned'
    (by one per lane from a multiple of `block`) or 'gather'."""
    outer, lane = tvm.tirx.Var("outer", "int32"), tvm.tirx.Var("lane", "int32")
    analyzer = tvm.sym.Analyzer()
    analyzer.bind(outer, tvm.ir.Range(0, 1 << 30))
    analyzer.bind(lane, tvm.ir.Range(0, block))
    base = substitute(index, {channel.__chandle__(): outer * block})
    step = analyzer.simplify(substitute(index, {channel.__chandle__(): outer * block + lane}) - base)
    if isinstance(step, tvm.tirx.IntImm) and step.value == 0:
        return "invariant"
    aligned = analyzer.simplify(tvm.tirx.floormod(base, block))
    if step.same_as(lane) and isinstance(aligned, tvm.tirx.IntImm) and aligned.value == 0:
        return "aligned"
    return "gather"


def blocked_conv_weight(op) -> te.Tensor | None:
    """The constant channel-blocked weight [.., F / b, C, kh, kw, b] of a 2-D convolution `op` (a reduction
    over the product of a 4-D map and the weight; horizontal.py's stacked convs carry a leading branch
    axis on both the weight and the output's first axis; an output stored in blocks by an earlier pass has
    five axes), else None."""
    found = conv(op)
    if found is None or found.layout != "NCHW" or not (is_map(op, "NCHW") or is_map(op, "NCHWc")):
        return None
    return found.weight_tensor if isinstance(found.weight_tensor.op, te.PlaceholderOp) else None


def _reduces_per_channel(op) -> bool:
    """Whether every read of a 4-D tensor in the reduction reads it at the output's own channel (a pool), or
    at a fixed offset from it (a pool over a concat folded into it: GoogLeNet's max pool over four branches;
    whether lanes stay aligned is `_gathers_channels`' question)."""
    channel = op.axis[1].var
    analyzer = tvm.sym.Analyzer()
    return all(not in_layout(ld, "NCHW") or isinstance(analyzer.simplify(ld.args[2] - channel), tvm.tirx.IntImm)
               for ld in tensor_loads(op.body[0]))


def _misfit(op, chosen, consumers, block: int) -> str:
    """Why `op` cannot store blocks ("" when it can): a reader that is not chosen, a convolution or a
    global pool, or a depthwise conv outside the set over channels `block` does not divide; or, unless `op`
    is a convolution, a full-size map it reads that is not chosen (a model input is read as before)."""
    for reader in consumers.get(op, []):
        if (reader not in chosen and blocked_conv_weight(reader) is None and conv2d(reader) is None
                and not _global_pool(reader)
                and (reader.reduce_axis or not REORDER_IN_READERS)):
            return f"its reader {reader.name} cannot read channel blocks"
        if reader not in chosen and _reads_in_lanes(reader) and int(reader.output(0).shape[1]) % block:
            # a depthwise conv left in NCHW over C channels the block does not divide vectorizes along its
            # rows, where blocked input lanes are 32 floats apart (EdgeNeXt's 88-channel 7x7: 0.014 -> 0.16 ms)
            return f"its reader {reader.name}, a depthwise conv kept in NCHW, would gather its blocks"
    if blocked_conv_weight(op) is not None:  # a dense conv broadcasts its input; a depthwise one reads it in lanes
        data = _data_load(op)
        step = _lane_step(data.args[2], op.axis[1].var, block)
        t = data.args[0]
        if step != "invariant" and isinstance(t.op, te.ComputeOp) and t.op not in chosen:
            return f"its channel lanes would gather {t.op.name}, which stays in its layout"
        return ""
    for load in tensor_loads(op.body[0]):
        t = load.args[0]
        if (in_layout(load, "NCHW") and isinstance(t.op, te.ComputeOp) and t.op not in chosen
                and [int(d) for d in t.shape[2:]] != [1, 1]):
            return f"it reads {t.op.name}, which stays in its layout"
    return ""


def _reads_in_lanes(op) -> bool:
    """Whether `op` is a convolution whose input channel moves with its output channel (depthwise, grouped)."""
    if blocked_conv_weight(op) is None:
        return False
    data = _data_load(op)
    return _lane_step(data.args[2], op.axis[1].var, 2) != "invariant"  # any block: whether it moves


def _data_load(op):
    """The load of a convolution's input map (its NCHW operand; `blocked_conv_weight` says it is one)."""
    return conv(op).data


def _other_size(block: int, widest: int) -> int:
    """The block size that is not `block`: two vectors (`widest`) or one."""
    return widest // 2 if block == widest else widest


def _global_pool(op) -> bool:
    """A per-channel reduction to one point per channel ([N, C, 1, 1]): it reduces one channel per vector
    lane over a blocked map (schedule/default.py)."""
    return (is_map(op) and op.num_outputs == 1 and bool(op.reduce_axis)
            and [int(d) for d in op.output(0).shape[2:]] == [1, 1] and _reduces_per_channel(op))


def in_blocks(op, block: int, mapping, padding: ChannelPadding | None = None, blocked_keys=()) -> te.Tensor:
    """`op` computed as [N, ceil(C / block), H, W, block]: its body at (n, cb * block + ci, y, x), reading
    the blocked tensors in their blocks (`mapping`: tensor key -> tensor or reader, as graph.sweep's reads).
    Where `block` does not divide C, its other reads are made safe past C by `padding` (`blocked_keys`: the
    maps stored in padded blocks; channel_padding.py)."""
    n, c, h, w = (int(d) for d in op.output(0).shape)
    blocks = -(-c // block)
    handles = [iv.var.__chandle__() for iv in op.axis]
    body = op.body[0]
    if blocks * block != c:
        body = padded_body(op, body, padding, block, blocked_keys)
    body = map_loads(body, read_through(mapping))
    extents = {iv.var: int(iv.dom.extent) for iv in op.reduce_axis}

    def blocked(i, cb, y, x, ci):
        value = substitute(body, dict(zip(handles, (i, cb * block + ci, y, x))))
        bounds = {i: n, cb: blocks, y: h, x: w, ci: block, **extents}
        return simplify_conditions(simplify_reads(value, bounds), bounds)
    return te.compute((n, blocks, h, w, block), blocked, name=f"{op.name}_c{block}", tag=op.tag)


def simplify_conditions(expr, extents):
    """`expr` with its selects' conditions simplified over `extents`: a concat at a multiple of the block
    chooses by block, cb * 32 + ci < 64 becomes cb < 2, the same for every lane (a vector, not a scalar
    loop of lane-dependent choices: DenseNet's concats)."""
    analyzer = tvm.sym.Analyzer()
    for var, extent in extents.items():
        analyzer.bind(var, tvm.ir.Range(0, extent))

    def visit(call):
        if not call.op.same_as(IF_THEN_ELSE):
            return call
        return tvm.tirx.if_then_else(analyzer.simplify(call.args[0]), call.args[1], call.args[2])
    return tvm_ffi.structural_map(expr, [(tvm.ir.Call, visit)])
