"""The convolution rule (several reduction axes, a product of two loads), CPU.

A register tile over two spatial axes, one of them vectorized - preferably an axis along which every load is
contiguous or invariant (output channels for a dense conv, whose weight block_conv_weights stores in
output-channel blocks; the output width for depthwise) - accumulated in a local buffer laid out
vector-innermost so it stays in registers. A dense conv over a long reduction tiles several output-channel
blocks at once (filter sets, as MLAS does), keeps its weights in L2-sized chunks and streams them beyond L2
(streaming.py); a masked last column tile runs apart (ragged.py); a kernel window is unrolled where the tile's
registers allow (TAPS_UNROLLED). The register budgets and the measured `Variant` are conv.py's.
"""

from __future__ import annotations

import logging
import math

from tvm import tirx
from tvm.sym import detect_linear_equation

from souffle_py.schedule.blocks import (
    block_loops, blocked_reductions, lane_access, loop_extent, operand_loads, unrolled_window, uses,
    vector_lanes,
)
from souffle_py.schedule.conv import (
    CONV_MIN_LANES, VARIANT, conv_accumulator_lanes, conv_broadcast_accumulator_lanes, conv_filter_set_registers,
    conv_lanes, conv_window_accumulators, taps_unrolled_registers,
)
from souffle_py.schedule.epilogue import fuse_elementwise_epilogue
from souffle_py.schedule.ragged import LAST_TILE_APART, tile_rows
from souffle_py.schedule.reductions import schedule_reduction
from souffle_py.schedule.rules.base import BlockRule
from souffle_py.schedule.streaming import AT, EACH, PIECE, stream_piece
from souffle_py.schedule.thresholds import (
    CHUNK_MIN_WEIGHT_BYTES, FILTER_SET_GAIN, GATHER_PENALTY, L2_CHUNK_BYTES, UNEVEN_SET_GAIN,
)
from te_passes.patterns import LAYOUT_RANKS

log = logging.getLogger(__name__)

CONV_LONG_REDUCTION = 64
CONV_UNROLLED_TAPS = 11
RAGGED_FILTER_SETS = True  # filter sets of two-vector blocks may take rows that do not divide the columns
UNEVEN_FILTER_SETS = True  # ... and sets of blocks that do not divide the blocks (`_filter_set`), where they do
TAPS_UNROLLED = True  # a conv's window unrolled in the schedule where its tile's registers allow


def schedule_conv(sch, block) -> None:
    """Register-tile two spatial axes (the vectorized one innermost), accumulate over all reduction axes in
    a local buffer, parallelize the fused outer loops; a plain reduction schedule where nothing vectorizes."""
    stmt = sch.get(block)
    spatial = [iv for iv in stmt.iter_vars if int(iv.iter_type) == 0]
    loads = [load for operand in (stmt.body.value.b.a, stmt.body.value.b.b) for load in operand_loads(operand)]
    terms = 1
    for iv in stmt.iter_vars:
        terms *= int(iv.dom.extent) if int(iv.iter_type) == 2 else 1
    tile = _conv_register_tile(spatial, loads, terms >= CONV_LONG_REDUCTION, unrolled_window(stmt, CONV_UNROLLED_TAPS))
    if tile is None:
        schedule_reduction(sch, block)
        return
    (v, lanes), (u, rows) = tile
    loops = block_loops(sch, block)
    if len(loops) != len(stmt.iter_vars):  # inside a time loop: the tile's axes are not the block's
        schedule_reduction(sch, block)
        return
    spatial_loops, reduce_loops = loops[:len(spatial)], loops[len(spatial):]
    # Output-channel blocks innermost of the outer loops when the input does not depend on them (a dense
    # conv: the input value is broadcast over the lanes): one tile's input rows (C x a row of columns) stay
    # in L1 for every block of output channels, instead of a pass over the whole input map per block
    # (ResNeXt's 256 -> 512 1x1 conv at 56 x 56 read its 3.2 MB input 16 times).
    inputs = [load for load in loads if lane_access(load, spatial[v].var, lanes) == "invariant"]
    outer_extents = [int(iv.dom.extent) // (lanes if i == v else 1) for i, iv in enumerate(spatial)]
    blocks = [i for i in range(len(spatial)) if i != u and inputs and outer_extents[i] > 1
              and not any(uses(index, spatial[i].var) for load in inputs for index in load.indices)]
    filters = 1
    if len(blocks) == 1 and terms >= CONV_LONG_REDUCTION:
        whole = lanes * 4 * outer_extents[blocks[0]] * terms < CHUNK_MIN_WEIGHT_BYTES  # its weights not in chunks
        rows, filters = _filter_set(int(spatial[u].dom.extent), rows, lanes, outer_extents[blocks[0]], whole)
    uneven = filters > 1 and outer_extents[blocks[0]] % filters != 0  # the last set masked (`_filter_set`)
    vo, vi = sch.split(spatial_loops[v], [None, lanes])
    uo, ui = sch.split(spatial_loops[u], [None, rows])
    outer = [vo if i == v else uo if i == u else loop for i, loop in enumerate(spatial_loops)]
    filter_loop = None
    if filters > 1:
        outer[blocks[0]], filter_loop = sch.split(outer[blocks[0]], [None, filters])
    chunks, piece = [], 0
    # in chunks whose weights stay in L2 (a 1024 -> 2048 conv's are 8 MB), like the GEMM; uneven sets stay whole
    if len(blocks) == 1 and not uneven:
        per_block = lanes * 4 * filters
        for loop in reduce_loops:
            per_block *= loop_extent(sch, loop)
        count = loop_extent(sch, outer[blocks[0]])
        per = max(d for d in range(1, count + 1) if count % d == 0 and d * per_block <= max(L2_CHUNK_BYTES, per_block))
        if per < count and VARIANT.get().stream:  # beyond L2: streamed over a small map, where each chunk's
                                                  # output stays in L2 too
            block_output = lanes * rows * 4 * math.prod(loop_extent(sch, loop) for i, loop in enumerate(outer)
                                                        if i not in blocks)
            weight = [load for load in loads if not any(load.same_as(i) for i in inputs)]
            piece = _streamed_piece(sch, count // per, per * block_output, reduce_loops[0], lanes, weight)
            if piece or count * per_block >= CHUNK_MIN_WEIGHT_BYTES:  # unstreamed chunks re-read the map
                chunk, outer[blocks[0]] = sch.split(outer[blocks[0]], [None, per])
                chunks = [chunk]
    # a masked last column tile: the column tiles innermost, serial, the last one apart (ragged.py)
    ragged = int(spatial[u].dom.extent) % rows != 0
    tiles = [loop for i, loop in enumerate(outer) if i not in blocks and not (ragged and i == u)]
    outer = chunks + tiles + [outer[i] for i in blocks] + ([uo] if ragged else [])
    if piece:  # the input channels in pieces outside the tiles (streaming.py): the chunk accumulates in `acc`
        log.debug("%s streams its weights in pieces of %d input channels", sch.get(block).name_hint, piece)
        piece_loop, reduce_loops[0] = sch.split(reduce_loops[0], [None, piece])
        outer = [*chunks, piece_loop, *outer[len(chunks):]]
    blocked = blocked_reductions(stmt, loads)  # channel blocks, x[r // 32, .., r % 32]: no division inside
    reduce_loops = [part for i, loop in enumerate(reduce_loops) for part in (
        sch.split(loop, [None, blocked[i]]) if i in blocked and loop_extent(sch, loop) % blocked[i] == 0
        and loop_extent(sch, loop) > blocked[i] else [loop])]
    sch.reorder(*outer, *reduce_loops, *([filter_loop] if filter_loop else []), ui, vi)
    window = [iv for iv in stmt.iter_vars if int(iv.iter_type) == 2][1:]  # the kernel window, after the channels
    vectors = -(-lanes // vector_lanes())
    if TAPS_UNROLLED and window and unrolled_window(stmt, CONV_UNROLLED_TAPS) and _window_registers(
            window, loads, spatial[u].var, rows, filters * vectors, 1 if inputs else vectors) \
            <= taps_unrolled_registers():
        taps = 1
        for loop in reversed(reduce_loops[-len(window):]):  # innermost first, at most CONV_UNROLLED_TAPS taps
            taps *= loop_extent(sch, loop)
            if taps > CONV_UNROLLED_TAPS:
                break
            if loop_extent(sch, loop) > 1:
                sch.unroll(loop)
    acc = sch.cache_write(block, 0, "local")
    sch.reverse_compute_at(acc, chunks[0] if piece else outer[-1])
    if v == len(spatial) - 1:  # a write-back in whole vectors (an NCHW one is scalar: its epilogue would be too)
        fuse_elementwise_epilogue(sch, acc)
    if v != len(spatial) - 1:  # vector lanes adjacent in the accumulator, or LLVM keeps it in memory
        sch.transform_layout(block, ("write", 0), lambda *idx: [*idx[:v], *idx[v + 1:], idx[v]])
    sch.vectorize(vi)
    sch.unroll(ui)
    if filter_loop is not None:
        sch.unroll(filter_loop)
    if v == len(spatial) - 1:  # channel-blocked output: the tile's rows are stored as whole vectors
        sch.vectorize(block_loops(sch, acc)[-1])
    else:  # NCHW: transposed element by element
        sch.unroll(block_loops(sch, acc)[-1])
    if piece:
        sch.parallel(chunks[0])
        sch.annotate(piece_loop, PIECE, piece * math.prod(int(d) for d in weight[0].source.shape[2:]))
        sch.annotate(reduce_loops[0], AT, weight[0].source.name)
        if filter_loop is not None:  # each of the tile's blocks prefetches its next piece
            sch.annotate(filter_loop, EACH, 1)
        sch.decompose_reduction(block, piece_loop)
    else:  # the loops over masked last tiles stay serial, innermost of the outer loops
        parallel = outer[:len(outer) - ragged - uneven]
        outer_fused = sch.fuse(*parallel) if len(parallel) > 1 else parallel[0] if parallel else None
        if outer_fused is not None and loop_extent(sch, outer_fused) > 1:
            sch.parallel(outer_fused)
        sch.decompose_reduction(block, reduce_loops[0])
    for loop in outer[len(outer) - ragged - uneven:]:  # each runs its last tile apart (ragged.py)
        if loop_extent(sch, loop) > 1:
            sch.annotate(loop, LAST_TILE_APART, 1)


def _window_registers(window, loads, column, rows: int, vectors: int, input_vectors: int) -> int:
    """The registers a conv's tile keeps live with its window unrolled, if LLVM holds each input until its
    last tap: `rows` x `vectors` partial sums, one tap's weight `vectors`, and the inputs of a window row
    along the columns ((rows - 1) x stride + (taps - 1) x dilation + 1 of them, each a broadcast register for
    a dense conv, `input_vectors` for a depthwise one); `window` the kernel window's iteration variables."""
    span = rows
    for load in loads:
        for index in load.indices:
            if not uses(index, column):
                continue
            coefficients = detect_linear_equation(index, [column, *(iv.var for iv in window)])
            if len(coefficients) != len(window) + 2 or not all(isinstance(c, tirx.IntImm) for c in coefficients):
                return 1 << 30
            span = max(span, (rows - 1) * int(coefficients[0]) + 1 + sum(
                (int(iv.dom.extent) - 1) * int(c) for iv, c in zip(window, coefficients[1:-1])))
    return (rows + 1) * vectors + span * input_vectors


def _filter_set(columns: int, rows: int, lanes: int, blocks: int, uneven: bool = False) -> tuple[int, int]:
    """(rows, output-channel blocks) of a dense conv's register tile (MLAS's filter sets): a tile spanning
    f blocks feeds each broadcast input value to f FMAs. The tile `rows` x 1 block, or fewer rows x the most
    blocks (a divisor of `blocks`) whose partial sums and weight vectors fit conv_filter_set_registers(),
    whichever does the most FMAs per load (counting a masked last tile's average rows), FILTER_SET_GAIN times
    more than the one-block tile: a 16-channel tile of 14 columns loads 15 vectors for 14 FMAs, 7 columns x
    3 blocks 10 for 21 (2.25x). The rows need not divide the columns (ragged.tile_rows): 28 columns of
    32-channel blocks take 6 x 2 blocks, the last tile masked (24 FMAs for 10 loads; 14 x 1 does 28 for 16,
    and 4 x 2, the divisor, 16 for 8): ResNet-50's strided 128 -> 128 3x3 at 28 x 28 180 -> 308 GFLOP/s, the
    model 3-4% faster; 16-channel tiles keep divisors of the columns (their sets were measured so). Where
    `uneven` (weights kept whole in L2), two-vector sets need not divide the blocks either, the last set
    masked (UNEVEN_FILTER_SETS), where that does UNEVEN_SET_GAIN times more FMAs per load than the best even
    tile: 7 blocks (224 channels) at 14 columns as 5 columns x (2 + 2 + 2 + 1) blocks, where divisors
    allowed 7 x 1 only (as MLAS's filter counts of 4 over any number of blocks). The variant of fewer
    partial sums (conv_accumulator_lanes(), measured against the default by variants.py) bounds the registers
    further."""
    registers = min(conv_filter_set_registers(), VARIANT.get().accumulator_lanes() // vector_lanes())
    vectors = -(-lanes // vector_lanes())

    def per_load(r: int, f: int) -> float:
        return r * f * vectors / (f * vectors + r)
    best, best_score = (rows, 1), FILTER_SET_GAIN * per_load(rows, 1)
    best_rate = per_load(rows, 1)
    uneven_set, uneven_rate = None, 0.0
    ragged = RAGGED_FILTER_SETS and vectors > 1  # two-vector blocks only: 16-channel tiles keep their divisors
    uneven = uneven and ragged and UNEVEN_FILTER_SETS
    for most in range(1, min(rows, columns) + 1):
        r, useful = tile_rows(columns, most) if ragged else (most, float(most))
        if r != most or (not ragged and columns % r):
            continue
        for f in range(2, blocks + 1):
            if f * vectors * (r + 1) > registers:
                continue
            if blocks % f == 0:
                rate = per_load(useful, f)
                if rate > best_score:
                    best, best_score, best_rate = (r, f), rate, rate
            elif uneven:
                rate = per_load(useful, blocks / -(-blocks // f))  # blocks per set on average
                if rate > uneven_rate:
                    uneven_set, uneven_rate = (r, f), rate
    return uneven_set if uneven_set and uneven_rate > UNEVEN_SET_GAIN * best_rate else best


def _streamed_piece(sch, chunks: int, chunk_output: int, channels_loop, lanes: int, weight) -> int:
    """Input channels per piece where a dense conv whose weights go beyond L2 streams them (streaming.py),
    else 0: `stream_piece` accepts its L2-sized chunks (smaller chunks over a 28 x 28 map were slower:
    512 -> 512, cold 1.57 -> 1.67 ms), its weight is one register tile wide per block ([F / b, C, kh, kw,
    b], b the tile's lanes) and C is reduced first."""
    if len(weight) != 1:
        return 0
    shape = [int(d) for d in weight[0].source.shape]
    channels = loop_extent(sch, channels_loop)
    if len(shape) != LAYOUT_RANKS["OIHWo"] or shape[1] != channels or shape[-1] != lanes:
        return 0
    return stream_piece(channels, chunks, chunk_output)


def _conv_register_tile(spatial, loads, long_reduction: bool = False, window: bool = False):
    """((vector axis, lanes), (unrolled axis, rows)) with the most lanes computed per reduction step, at most
    conv_accumulator_lanes() partial sums (conv_broadcast_accumulator_lanes() over a `long_reduction` where an
    operand is broadcast over the lanes; of those at most conv_window_accumulators() registers, the widest
    vector first, where the innermost reduction is an unrolled kernel `window`) and no partial tiles; lanes
    a power of two (conv_lanes()) unless none divides any axis, gathers count 1/GATHER_PENALTY, ties go to
    wider vectors. The unrolled axis is the innermost other spatial axis longer than one. None when no axis
    has a vector tile."""
    widest, powers_of_two = VARIANT.get().max_lanes(), conv_lanes()
    for widths in (lambda extent: [w for w in powers_of_two if w <= widest],  # any other divisor only where no
                   # power of two divides an axis
                   lambda extent: range(min(extent, widest), CONV_MIN_LANES - 1, -1)):
        best = _best_conv_tile(spatial, loads, long_reduction, window, widths)
        if best is not None:
            return best
    return None


def _best_conv_tile(spatial, loads, long_reduction: bool, window: bool, widths):
    """_conv_register_tile over the vector widths `widths(extent)` of each axis."""
    best, best_score = None, (0.0, 0)
    for v, iv in enumerate(spatial):
        extent = int(iv.dom.extent)
        others = sorted((u for u in range(len(spatial)) if u != v), key=lambda u: int(spatial[u].dom.extent) > 1)
        if not others:
            continue
        u = others[-1]
        for lanes in widths(extent):
            if extent % lanes:
                continue
            access = [lane_access(load, iv.var, lanes) for load in loads]
            broadcast = long_reduction and "invariant" in access
            budget = min(conv_broadcast_accumulator_lanes() if broadcast else conv_accumulator_lanes(),
                         VARIANT.get().accumulator_lanes())
            most = budget // lanes
            window_bound = window and broadcast  # measured on dense convs only (depthwise ones load their input)
            if window_bound:  # in registers: a row of fewer lanes than a vector still takes one
                most = min(most, conv_window_accumulators() // -(-lanes // vector_lanes()))
            rows, useful = tile_rows(int(spatial[u].dom.extent), most)
            # under the window's bound, rated by the registers it may fill, so that ties go to the wider
            # vector (rated by its whole tiles, 16 lanes x 19 columns outscored 32 x 8 at 56 columns and
            # lost the filter sets: ResNet-18's 64 -> 64 3x3 convs 18% slower)
            filled = min(most, int(spatial[u].dom.extent)) if window_bound else useful
            score = (filled * lanes / (GATHER_PENALTY if "gather" in access else 1), lanes)
            if score > best_score:
                best, best_score = ((v, lanes), (u, rows)), score
    return best


class ConvTile(BlockRule):
    """A register tile over two spatial axes, one vectorized, accumulated in registers (module docstring)."""

    name = "conv"
    kind = "conv"
    schedule = staticmethod(schedule_conv)
