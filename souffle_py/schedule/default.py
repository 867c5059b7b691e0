"""Rule-based default CPU schedules, applied to every sblock of a PrimFunc by its kind.

- GEMM-like (one reduction axis, two or more spatial axes, a product of two loads): register tiles of
  TILE_I x TILE_J accumulated in a local buffer, the j tile vectorized, outer tiles parallel.
- Convolution-like (several reduction axes, a product of two loads): a register tile over two spatial axes,
  one of them vectorized — preferably an axis along which every load is contiguous or invariant (output
  channels for an ordinary conv, whose weight the frontend stores in output-channel blocks; the output
  width for depthwise) — accumulated in a local buffer laid out vector-innermost so it stays in registers.
- Other reductions (softmax/layernorm rows, means): parallel over the spatial axes, reduction innermost;
  sums over ragged rows (197 columns, a 7 x 7 pool) in masked vector lanes (reductions.py, flat.py); a
  softmax or LayerNorm chain over more than 4 MB row by row under its epilogue's row loop (row_chains.py).
- Padding (an injective block storing if_then_else(inside, x[...], constant)): rows in parallel, each row
  cut at the borders into plain loops (flat.py); vectorizing a lane-dependent condition would scalarize
  the whole fused loop.
- Injective (elementwise, broadcast, reshape, transpose...): all loops fused, parallel + vectorized; where
  no vector width divides the row, over the flattened contiguous axes with a tail loop (flat.py).
- A model of little work, and a recurrence whose steps are, run on one thread (threads.py).
- Dense convs over small maps and GEMMs over few rows stream weights beyond L2 in pieces (streaming.py).
Untuned code is 50-100x slower than ONNX Runtime on BERT here, so even the default must be a real
schedule; tuned MetaSchedule records (tuning.py) replace these where the database has them.
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import math

from tvm import s_tir, tirx

from souffle_py.schedule.blocks import (
    PARALLEL_MIN, VECTOR, block_kind, block_loops, blocked_reductions, calls_function, columns_gather, has_condition, lane_access, leaf_blocks,
    loop_extent, operand_loads, conjuncts_kept, realize_predicate, stores_bool, unrolled_window, uses, weight_panel,
)
from souffle_py.schedule.flat import (
    partitions_last, cut_at_conditions, vectorize_injective,
)
from souffle_py.schedule.bf16_conv import is_bf16_conv, schedule_bf16_conv
from souffle_py.schedule.bf16_gemm import is_bf16_gemm, schedule_bf16_gemm
from souffle_py.schedule.gates import cell_update, gate_projection
from souffle_py.schedule.reductions import reduces_in_vector_lanes, row_lanes, schedule_reduction
from souffle_py.schedule.row_chains import schedule_row_chains
from souffle_py.schedule.softmax_gemms import schedule_softmax_gemms
from souffle_py.schedule.ragged import (
    LAST_TILE_APART, RAGGED_TILE_GAIN, inline_output_copy, pad_to_tiles, tile_rows,
)
from souffle_py.schedule.finish import finish_schedule
from souffle_py.schedule.streaming import AT, EACH, PIECE, stream_piece
from souffle_py.schedule.threads import (
    OneThread, one_parallel_region, serial_recurrences, time_loops_of,
)
from te_passes.gate_projections import GATE_BLOCKS, GATE_CELL

log = logging.getLogger(__name__)


# The GEMM register tile: TILE_I rows x TILE_J columns (two vectors) of accumulators where the rows allow
# (BERT's 128 x 768 x 768: 8 x 32 ~350-460 GFLOP/s here, 4 x 64 ~280, 8 x 64 spills). Other shapes fill up
# to ACCUMULATORS vector registers (AVX-512 has 32: 20 accumulators leave room for the weight vectors and
# the broadcast row value; AVX2 has 16).
TILE_I = 8 if VECTOR >= 16 else 4
TILE_J = 2 * VECTOR
ACCUMULATORS = 20 if VECTOR >= 16 else 8
L2_CHUNK_BYTES = 256 * 1024  # packed weight panels per GEMM column chunk (half a Zen 5 core's L2)
CHUNK_MIN_WEIGHT_BYTES = 1 << 20  # a conv's weights, not streamed, in chunks of output channels only from
                                  # this size: smaller ones stay in L2 whole, and each chunk re-reads the input
                                  # map (a GoogLeNet stage: 3.45 ms in chunks, 2.11 whole; the models, fresh
                                  # databases: SqueezeNet 0.95x, DenseNet-121 0.96x, GoogLeNet 0.98x)
CONV_MAX_LANES = 2 * VECTOR   # widest vector tried for a convolution (two registers: dense convs, whose
                              # weights te_passes/conv_layout.py blocks by this many output channels)
CONV_MIN_LANES = 4
# Vector widths a conv tile may take: powers of two only. Any other divisor (a 1x1 conv over 104 channels
# took 26 or 28 lanes) is a vector LLVM builds element by element (588 vinsertps: 23.7x ONNX Runtime);
# channel counts that no power of two divides are padded up to the block instead (channel_padding.py).
CONV_LANES = tuple(w for w in (2 * VECTOR, VECTOR, VECTOR // 2, VECTOR // 4)
                   if CONV_MIN_LANES <= w <= CONV_MAX_LANES)
CONV_ACCUMULATOR_LANES = 224  # partial sums kept in registers: 14 of the 32 AVX-512 registers (Zen 5 here)
CONV_BROADCAST_ACCUMULATOR_LANES = 448  # ... 28 where the input is one broadcast value per row and the
                                        # reduction has CONV_LONG_REDUCTION terms or more (a dense conv's 32
                                        # channels x 14 columns: the weight's two vectors and the broadcast take
                                        # the other registers; 1x1 convs at 14 x 14 152 -> 161 GFLOP/s; over 16
                                        # or 27 terms, EfficientNet's stem and first expand conv, 1.2-2x slower)
CONV_LONG_REDUCTION = 64
CONV_WINDOW_ACCUMULATORS = 20  # ... and at most this many registers of them where the innermost reduction
                               # is a kernel window of at most CONV_UNROLLED_TAPS taps, which LLVM unrolls
                               # (blocks.unrolled_window)
                               # (3x3 convs in 32-channel blocks over 13 or 14 columns spill: 64 -> 256 at
                               # 13 x 13 0.237 -> 0.184 ms, 256 -> 256 strided to 14 x 14 1.32 -> 0.77-0.83
                               # ms, both as 5 columns x 2 blocks); filter sets keep their registers
CONV_UNROLLED_TAPS = 11
CONV_FILTER_SET_REGISTERS = 28  # partial sums and weight vectors of a filter set (_filter_set): 32 less the
                                # broadcast input and spare registers
FILTER_SET_GAIN = 1.25  # FMAs per load a filter set must gain over the one-block tile (16-channel blocks at
                        # 14 x 14 and 28 x 28, 2.25x: 1x1 0.06 -> 0.05 ms, 3x3 96 -> 96 at 28 x 28 1.0 -> 0.39)
GEMM_EPILOGUE = True  # a GEMM's elementwise reader runs in its write-back (`_fuse_elementwise_epilogue`): Swin-B's
                     # QKV bias add, 1.5% of the model; BERT, ViT, GPT-2, DeiT, LeViT, Whisper within +-1%
RAGGED_FILTER_SETS = True  # filter sets of two-vector blocks may take rows that do not divide the columns
GATHER_PENALTY = 4            # a vector that must gather some operand element by element is worth less
STREAM_GEMM_ROWS = 128        # GEMMs of at most this many rows stream their weights (streaming.py): with its
                              # weights cold, BERT's 128 x 768 x 3072 2.31 -> 2.07 ms, 49 x 4096 x 1024 1.98 ->
                              # 1.77; Swin-B's 196 x 512 x 2048 1.58 either way, but 7% slower hot (the model 1.7%)


@dataclasses.dataclass(frozen=True)
class Variant:
    """A default-schedule variant of the conv and GEMM rules (schedule/variants.py measures a few at compile
    time): whether weights may stream beyond L2 (streaming.py), the widest conv vector, the most partial
    sums a conv tile keeps in registers (also bounding its filter sets, `_filter_set`)."""

    stream: bool = True
    conv_max_lanes: int = CONV_MAX_LANES
    conv_accumulator_lanes: int = CONV_BROADCAST_ACCUMULATOR_LANES  # at most this many partial sums


VARIANT = contextvars.ContextVar("souffle_schedule_variant", default=Variant())


def schedule_cpu(func: tirx.PrimFunc, names=None, one_thread: bool = False) -> tirx.PrimFunc:
    """`func` with a default schedule on each of its sblocks, or on those named in `names` (the others are
    scheduled already); unchanged blocks where a rule does not fit. one_thread: no parallel loop at all
    (a model of little work, `runs_on_one_thread`)."""
    sch = s_tir.Schedule(func)
    serial_steps, serial_blocks = serial_recurrences(func)
    time_loops = time_loops_of(sch)  # before the rules, which leave them as they are
    _apply_rules(sch, [sch.get(block).name_hint for block in leaf_blocks(sch)] if names is None else names,
                 lambda name: one_thread or name in serial_blocks)
    for i, time_loop in enumerate(time_loops):
        if not one_thread and i not in serial_steps:
            one_parallel_region(sch, time_loop)
    return finish_schedule(sch.mod["main"])


def schedule_blocks(sch: s_tir.Schedule, names, one_thread: bool = False) -> None:
    """The default schedule on the sblocks named `names` of `sch` (the others stay as they are: a merged
    kernel's tuned stages, schedule/staged.py). Blocks are looked up by name and nothing else is, so the
    trace replays on any function with blocks of those names (a stage's default competes in tuning)."""
    _, serial_blocks = serial_recurrences(sch.mod["main"])
    _apply_rules(sch, names, lambda name: one_thread or name in serial_blocks)


def _apply_rules(sch: s_tir.Schedule, names, on_one_thread) -> None:
    """Each named block's rule, through OneThread where `on_one_thread(name)`; loop partitions last (flat.py)."""
    with partitions_last():
        names = list(names)
        threaded = [n for n in names if not on_one_thread(n)]
        chained = schedule_softmax_gemms(sch, threaded)  # attention's softmax under P.V's row tiles
        chained |= schedule_row_chains(sch, [n for n in threaded if n not in chained])
        for name in (n for n in names if n not in chained):
            try:
                block = sch.get_sblock(name)
            except Exception:  # inlined into an earlier block's schedule (a conv's epilogue)
                continue
            kind = ("bf16_gemm" if is_bf16_gemm(sch, block) else "bf16_conv" if is_bf16_conv(sch, block)
                    else block_kind(sch, block))
            try:  # every primitive preserves semantics: a rule that stops halfway leaves a valid, slower schedule
                RULES[kind](OneThread(sch) if on_one_thread(name) else sch, block)
            except Exception as exc:
                log.debug("default %s schedule skipped for %s: %s", kind, name, exc)


def register_tile(rows: int, cols: int, masked_columns: bool = True) -> tuple[int, int]:
    """(tile_i, tile_j): the GEMM register tile; a masked last row tile only where no divisor of the rows
    fits (ragged.tile_rows), whole vectors over padded columns where no vector divides them (unless not
    `masked_columns`). TILE_I x TILE_J where the shape allows; otherwise the most accumulator lanes within
    ACCUMULATORS vectors, ties to more rows (each row shares the loaded weight vectors), at least min(rows, 4)
    rows, and tile_j a power-of-two number of vectors (LLVM scalarizes a 48-lane vector: ~16 GFLOP/s). 100
    rows: 5 x 64 (~365 GFLOP/s on an LSTM's 100x1024x256; 5 x 32 ~210, 4 x 64 ~300); 49 rows: 7 x 32; a GEMV
    (one row): 1 x 256, whose 16 independent accumulator chains hide the FMA latency (1 x 32 made an LSTM step
    ~3x slower)."""
    if rows % TILE_I == 0 and cols % TILE_J == 0:
        return TILE_I, TILE_J
    widths = [VECTOR << n for n in range(8) if VECTOR << n <= ACCUMULATORS * VECTOR]

    def columns(tile_i: int) -> int:  # the widest vector tile dividing the columns within the registers
        return next((w for w in reversed(widths) if w <= ACCUMULATORS * VECTOR // tile_i and cols % w == 0), 1)
    best, best_lanes = (1, 1), 0
    for tile_i in range(min(rows, TILE_I), 0, -1):
        if rows % tile_i or tile_i < min(rows, 4):
            continue
        tile_j = columns(tile_i)
        if tile_i * tile_j > best_lanes:
            best, best_lanes = (tile_i, tile_j), tile_i * tile_j
    tile_i, tile_j = best
    ragged, useful = tile_rows(rows, TILE_I)
    if rows % ragged and tile_i < min(rows, 4) and useful > RAGGED_TILE_GAIN * tile_i:
        tile_i = ragged  # 197 tokens (ViT, DeiT), a prime: 1 x 1 tiles before, 2.4 GFLOP/s
        tile_j = columns(tile_i)
    if masked_columns and tile_j < VECTOR <= cols and rows > 1:  # no vector divides the columns (197 keys):
        # whole vector tiles over columns padded up to them (ragged.pad_to_tiles)
        tile_j = TILE_J if cols >= TILE_J and tile_i * TILE_J <= ACCUMULATORS * VECTOR else VECTOR
    return tile_i, tile_j


def _gemm(sch, block) -> None:
    if GATE_BLOCKS in sch.get(block).annotations and gate_projection(sch, block):  # an LSTM step (gates.py)
        return
    *outer, i, j, k = block_loops(sch, block)
    copy, masked = None, True
    tile_i, tile_j = register_tile(loop_extent(sch, i), loop_extent(sch, j))
    if loop_extent(sch, j) % tile_j:
        copy = pad_to_tiles(sch, block, tile_i, tile_j)
        masked = copy is not None  # else one column at a time, as before
        *outer, i, j, k = block_loops(sch, block)
    write_back = _gemm_tiles(sch, block, outer, i, j, k, masked)
    inline_output_copy(sch, copy)
    if copy is None and write_back is not None and GEMM_EPILOGUE:
        _fuse_elementwise_epilogue(sch, write_back)


def _gemm_tiles(sch, block, outer, i, j, k, masked_columns: bool):
    """Register-tile the GEMM `block`; returns its accumulator's write-back block (None where a one-row GEMV
    became vector-lane dot products instead)."""
    outer, shared = _rows_sharing_the_weights(sch, block, outer, (i, j, k))
    rows = loop_extent(sch, i)
    for loop in outer[len(outer) - shared:]:
        rows *= loop_extent(sch, loop)
    weight = weight_panel(sch, block)
    panel = int(weight.source.shape[-1]) if weight is not None else None
    # weights packed in panels of this width (te_passes/layout.py) fix the tile's columns, and its rows are
    # chosen for them: Swin-B's 196 rows took 4 rows (of a 4 x 64 tile) by 32 panel columns, 8 accumulators at
    # 190 GFLOP/s; 7 x 32 made the model 162 -> 136 ms
    cols = panel or loop_extent(sch, j)
    # [T, B] x [K, N] (an LSTM's input projection): one GEMM of T*B rows, not T GEMVs. Only where each
    # register tile stays inside one row of the outer loops (or the row loop has extent 1): a tile across
    # that boundary has a non-affine region, and the accumulator's write-back would copy beyond it.
    if shared and (loop_extent(sch, i) == 1 or
                   loop_extent(sch, i) % register_tile(rows, cols, masked_columns)[0] == 0):
        i = sch.fuse(*outer[len(outer) - shared:], i)
        outer = outer[:len(outer) - shared]
    tile_i, tile_j = register_tile(loop_extent(sch, i), cols, masked_columns)
    if not panel and (tile_j < VECTOR or columns_gather(sch, block)) and loop_extent(sch, i) == 1 \
            and reduces_in_vector_lanes(sch, block, [k]):
        # a GEMV with no column vector (EfficientNet's classifier: 1000 columns of a weight read transposed,
        # W[j, k]) or whose column vector would gather (MobileNetV3's 1024 columns: 0.65 -> 0.054 ms), but
        # every operand contiguous along k: dot products in vector lanes (1.7 -> 0.18 ms), not a scalar FMA
        # chain per output. Only one row: Swin's 49 x 49 x 32 window scores (Q K^T) keep their
        # 7-row register tile (as dot products of 32 terms they made Swin-B 25% slower)
        schedule_reduction(sch, block)
        return
    if panel:  # weights packed in panels of this width (te_passes/layout.py): one contiguous read per k
        tile_j = panel
    io, ii = sch.split(i, [None, tile_i])
    jo, ji = sch.split(j, [None, tile_j])
    chunks, piece = [], 0
    if panel:  # column chunks whose panels fit in L2, reused there by every row tile
        tiles = loop_extent(sch, jo)
        per = max(1, L2_CHUNK_BYTES // (loop_extent(sch, k) * tile_j * 4))
        per = max(d for d in range(1, min(per, tiles) + 1) if tiles % d == 0)
        chunk, jo = sch.split(jo, [None, per])
        chunks = [chunk]
        rows = loop_extent(sch, io) * tile_i  # few (BERT's 128): each panel is reused by few row tiles
        if rows <= STREAM_GEMM_ROWS and VARIANT.get().stream:
            piece = stream_piece(loop_extent(sch, k), loop_extent(sch, chunk), rows * per * tile_j * 4)
    if piece:
        log.debug("%s streams its weight panels in pieces of %d", sch.get(block).name_hint, piece)
        piece_loop, k = sch.split(k, [None, piece])
        sch.reorder(*outer, chunk, piece_loop, io, jo, k, ii, ji)
    else:
        sch.reorder(*outer, *chunks, io, jo, k, ii, ji)
    acc = sch.cache_write(block, 0, "local")
    sch.reverse_compute_at(acc, chunk if piece else jo)
    # loop annotations first: parallel/vectorize refuse a reduction block whose init was split off
    if tile_j >= VECTOR:
        sch.vectorize(ji)
        sch.vectorize(block_loops(sch, acc)[-1])
    sch.unroll(ii)
    if piece:
        sch.parallel(sch.fuse(*outer, chunk) if outer else chunk)
        sch.annotate(piece_loop, PIECE, piece * tile_j)
        sch.annotate(k, AT, weight.source.name)
        sch.decompose_reduction(block, piece_loop)
        return acc
    outer_fused = sch.fuse(*outer, *chunks, io, jo)
    if loop_extent(sch, outer_fused) > 1:
        sch.parallel(outer_fused)
    sch.decompose_reduction(block, k)
    return acc


def _rows_sharing_the_weights(sch, block, outer, inner) -> tuple[list, int]:
    """(`outer` reordered, n): the outer spatial loops with those the weights (the operand indexed by the
    column axis) depend on moved outside the others, in order otherwise, and n the number of loops the
    weights do not depend on, now innermost: those loops and the row loop form one row axis. A batch axis
    of a batched matmul indexes both operands and stays outer. A bidirectional recurrence's input
    projection [T, D, B, N] = x[T, B, K] @ W[D, K, N] thus becomes D GEMMs of T * B rows, not T * D GEMVs
    that each stream W[d] (2 MB with a 512-wide input, beyond L2). Nothing is reordered (and the trace has
    no reorder) where no independent loop of more than one iteration sits outside a dependent one: then n
    counts the independent loops inside the innermost dependent one."""
    stmt = sch.get(block)
    iter_vars = list(stmt.iter_vars)[-(len(outer) + 3):]  # outer..., row, column, reduction
    column = iter_vars[-2].var
    product = stmt.body.value.b
    weights = [x for x in (product.a, product.b) if uses(x, column)]
    if len(weights) != 1:
        return outer, 0
    depends = [uses(weights[0], iv.var) for iv in iter_vars[:len(outer)]]
    if any(not d and loop_extent(sch, loop) > 1 and any(depends[n + 1:])
           for n, (loop, d) in enumerate(zip(outer, depends))):
        outer = [l for l, d in zip(outer, depends) if d] + [l for l, d in zip(outer, depends) if not d]
        sch.reorder(*outer, *inner)
        return outer, depends.count(False)
    shared = 0
    for d in reversed(depends):
        if d:
            break
        shared += 1
    return outer, shared


def _injective(sch, block) -> None:
    """All loops fused, parallel, and vectorized within the innermost axis (of extent > 1): VECTOR lanes
    where they divide it, else the widest power of two (at least 4) that does. A vector across rows (56
    columns of an NCHW map) gathers and scatters element by element: TVM flattens the buffers after
    simplifying, so (f // 196) * 3136 + (f % 196 * 16 + l) // 56 * 56 + (f * 16 + l) % 56 stays per-lane
    arithmetic (BN + SiLU over 144 x 56 x 56: 0.48 ms, a numpy copy of it 0.13 ms)."""
    stmt = sch.get(block)
    if GATE_CELL in stmt.annotations and cell_update(sch, block):  # an LSTM step (gates.py)
        return
    loops = block_loops(sch, block)
    if not loops:
        return
    total = 1
    for loop in loops:
        total *= loop_extent(sch, loop)
    inner = max((i for i, loop in enumerate(loops) if loop_extent(sch, loop) > 1), default=len(loops) - 1)
    lanes = row_lanes(loop_extent(sch, loops[inner]))
    # conditions on other axes than the vector's are the same for every lane (a recurrence's t == 0, Swin's
    # shifted-window halves selected by row and column while the vector runs along the channels)
    vector_axis = len(stmt.iter_vars) - len(loops) + inner  # iter vars: any time axes, then one per loop
    uniform = [iv.var for i, iv in enumerate(stmt.iter_vars) if i != vector_axis]
    row_vector = lanes and not has_condition(stmt.body, uniform)
    # rows no vector width divides (7, 14, 49, 197) or a condition along the row: one flat vector run over
    # the innermost axes that allow it, with a masked tail (flat.py)
    time_axes = len(stmt.iter_vars) - len(loops)
    # (rows cut at a condition along them, as for pads, made Swin-B 166 -> 256 ms on one thread: not here)
    if (lanes != VECTOR or not row_vector) and not stores_bool(sch, block) and vectorize_injective(
            sch, block, loops, time_axes, PARALLEL_MIN):
        return
    if row_vector and not stores_bool(sch, block):
        row, lane = sch.split(loops[inner], [None, lanes])
        if inner < len(loops) - 1:  # unit loops after the row move out of the vector's way
            sch.reorder(*loops[inner + 1:], lane)
        outer = sch.fuse(*loops[:inner], row, *loops[inner + 1:]) if len(loops) > 1 else row
        sch.vectorize(lane)
    else:
        outer = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    if total >= PARALLEL_MIN:
        sch.parallel(outer)


def _conv(sch, block) -> None:
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
        rows, filters = _filter_set(int(spatial[u].dom.extent), rows, lanes, outer_extents[blocks[0]])
    vo, vi = sch.split(spatial_loops[v], [None, lanes])
    uo, ui = sch.split(spatial_loops[u], [None, rows])
    outer = [vo if i == v else uo if i == u else loop for i, loop in enumerate(spatial_loops)]
    filter_loop = None
    if filters > 1:
        outer[blocks[0]], filter_loop = sch.split(outer[blocks[0]], [None, filters])
    chunks, piece = [], 0
    if len(blocks) == 1:  # in chunks whose weights stay in L2 (a 1024 -> 2048 conv's are 8 MB), like the GEMM
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
    acc = sch.cache_write(block, 0, "local")
    sch.reverse_compute_at(acc, chunks[0] if piece else outer[-1])
    if v == len(spatial) - 1:  # a write-back in whole vectors (an NCHW one is scalar: its epilogue would be too)
        _fuse_elementwise_epilogue(sch, acc)
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
    else:
        outer_fused = sch.fuse(*outer[:len(outer) - ragged])
        if loop_extent(sch, outer_fused) > 1:
            sch.parallel(outer_fused)
        sch.decompose_reduction(block, reduce_loops[0])
    if ragged and loop_extent(sch, uo) > 1:
        sch.annotate(uo, LAST_TILE_APART, 1)


def _filter_set(columns: int, rows: int, lanes: int, blocks: int) -> tuple[int, int]:
    """(rows, output-channel blocks) of a dense conv's register tile (MLAS's filter sets): a tile spanning
    f blocks feeds each broadcast input value to f FMAs. The tile `rows` x 1 block, or fewer rows x the most
    blocks (a divisor of `blocks`) whose partial sums and weight vectors fit CONV_FILTER_SET_REGISTERS,
    whichever does the most FMAs per load (counting a masked last tile's average rows), FILTER_SET_GAIN times
    more than the one-block tile: a 16-channel tile of 14 columns loads 15 vectors for 14 FMAs, 7 columns x
    3 blocks 10 for 21 (2.25x). The rows need not divide the columns (ragged.tile_rows): 28 columns of
    32-channel blocks take 6 x 2 blocks, the last tile masked (24 FMAs for 10 loads; 14 x 1 does 28 for 16,
    and 4 x 2, the divisor, 16 for 8): ResNet-50's strided 128 -> 128 3x3 at 28 x 28 180 -> 308 GFLOP/s, the
    model 3-4% faster; 16-channel tiles keep divisors of the columns (their sets were measured so). The
    variant of fewer partial sums (CONV_ACCUMULATOR_LANES, measured against the default by variants.py)
    bounds the registers further."""
    registers = min(CONV_FILTER_SET_REGISTERS, VARIANT.get().conv_accumulator_lanes // VECTOR)
    vectors = -(-lanes // VECTOR)

    def per_load(r: int, f: int) -> float:
        return r * f * vectors / (f * vectors + r)
    best, best_score = (rows, 1), FILTER_SET_GAIN * per_load(rows, 1)
    ragged = RAGGED_FILTER_SETS and vectors > 1  # two-vector blocks only: 16-channel tiles keep their divisors
    for most in range(1, min(rows, columns) + 1):
        r, useful = tile_rows(columns, most) if ragged else (most, float(most))
        if r != most or (not ragged and columns % r):
            continue
        f = max(d for d in range(1, blocks + 1) if blocks % d == 0 and (d == 1 or d * vectors * (r + 1) <= registers))
        if f > 1 and per_load(useful, f) > best_score:
            best, best_score = (r, f), per_load(useful, f)
    return best


def _streamed_piece(sch, chunks: int, chunk_output: int, channels_loop, lanes: int, weight) -> int:
    """Input channels per piece where a dense conv whose weights go beyond L2 streams them (streaming.py),
    else 0: `stream_piece` accepts its L2-sized chunks (smaller chunks over a 28 x 28 map were slower:
    512 -> 512, cold 1.57 -> 1.67 ms), its weight is one register tile wide per block ([F / b, C, kh, kw,
    b], b the tile's lanes) and C is reduced first."""
    if len(weight) != 1:
        return 0
    shape = [int(d) for d in weight[0].source.shape]
    channels = loop_extent(sch, channels_loop)
    if len(shape) != 5 or shape[1] != channels or shape[-1] != lanes:
        return 0
    return stream_piece(channels, chunks, chunk_output)


def _fuse_elementwise_epilogue(sch, write_back) -> None:
    """Compute the elementwise block that alone reads a convolution's or a GEMM's output (batch norm + ReLU,
    a residual add, a bias add) in its write-back of each register tile, while the tile is in registers:
    one pass over the map and one intermediate map fewer (ONNX Runtime's fused Conv + Add + ReLU). Left
    alone when the output has other readers or is the function's output, which TVM's reverse_compute_inline
    refuses, and when the block calls a function (EfficientNet's SiLU), which costs the conv's write-back
    more than its own vectorized pass does (EfficientNet-b0 ~2% slower with it fused)."""
    readers = sch.get_consumers(write_back)
    if len(readers) != 1 or block_kind(sch, readers[0]) != "injective" or calls_function(sch.get(readers[0]).body):
        return
    # TVM's reverse_compute_inline gives the write-back the reader's predicate in place of its own: a
    # masked tile's write-back with a reader outside the channel blocks (c < C) then stored past its row.
    # A masked write-back is inlined on a copy first (the copy's queries stay out of this schedule's trace).
    before = realize_predicate(sch, write_back)
    if before is not None:
        name = sch.get(write_back).name_hint
        trial = sch.copy()
        try:
            trial.reverse_compute_inline(trial.get_sblock(sch.get(readers[0]).name_hint))
        except Exception as exc:  # tvm.s_tir.ScheduleError: checked before anything changes
            log.debug("conv epilogue not fused: %s", str(exc).splitlines()[0])
            return
        if not conjuncts_kept(realize_predicate(trial, trial.get_sblock(name)), before):
            log.debug("conv epilogue of %s not fused: its write-back would lose its predicate %s", name, before)
            return
    try:
        sch.reverse_compute_inline(readers[0])
    except Exception as exc:  # tvm.s_tir.ScheduleError: checked before anything changes
        log.debug("conv epilogue not fused: %s", str(exc).splitlines()[0])


def _conv_register_tile(spatial, loads, long_reduction: bool = False, window: bool = False):
    """((vector axis, lanes), (unrolled axis, rows)) with the most lanes computed per reduction step, at most
    CONV_ACCUMULATOR_LANES partial sums (CONV_BROADCAST_ACCUMULATOR_LANES over a `long_reduction` where an
    operand is broadcast over the lanes; of those at most CONV_WINDOW_ACCUMULATORS registers, the widest
    vector first, where the innermost reduction is an unrolled kernel `window`) and no partial tiles; lanes
    a power of two (CONV_LANES) unless none divides any axis, gathers count 1/GATHER_PENALTY, ties go to
    wider vectors. The unrolled axis is the innermost other spatial axis longer than one. None when no axis
    has a vector tile."""
    widest = VARIANT.get().conv_max_lanes
    for widths in (lambda extent: [w for w in CONV_LANES if w <= widest],  # any other divisor only where no
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
            budget = min(CONV_BROADCAST_ACCUMULATOR_LANES if broadcast else CONV_ACCUMULATOR_LANES,
                         VARIANT.get().conv_accumulator_lanes)
            most = budget // lanes
            window_bound = window and broadcast  # measured on dense convs only (depthwise ones load their input)
            if window_bound:  # in registers: a row of fewer lanes than a vector still takes one
                most = min(most, CONV_WINDOW_ACCUMULATORS // -(-lanes // VECTOR))
            rows, useful = tile_rows(int(spatial[u].dom.extent), most)
            # under the window's bound, rated by the registers it may fill, so that ties go to the wider
            # vector (rated by its whole tiles, 16 lanes x 19 columns outscored 32 x 8 at 56 columns and
            # lost the filter sets: ResNet-18's 64 -> 64 3x3 convs 18% slower)
            filled = min(most, int(spatial[u].dom.extent)) if window_bound else useful
            score = (filled * lanes / (GATHER_PENALTY if "gather" in access else 1), lanes)
            if score > best_score:
                best, best_score = ((v, lanes), (u, rows)), score
    return best


def _pad(sch, block) -> None:
    """Rows in parallel, each row a serial loop whose condition LLVM can hoist or mask; the row vectorized
    where the condition does not depend on it (a pad storing channel blocks, te_passes/conv_layout.py):
    then the whole vector is either inside or padding, and the columns stay a serial loop of their own
    (fused into the parallel loop, every vector recomputed its row and column from the fused index:
    EfficientNet's 96 x 114 x 114 blocked pad with BN + SiLU 0.89 -> 0.65 ms)."""
    loops = block_loops(sch, block)
    stmt = sch.get(block)
    *outer, inner = loops
    if not outer:
        return
    blocked = (loop_extent(sch, inner) % VECTOR == 0 and len(stmt.iter_vars) == len(loops) and len(outer) >= 2
               and not uses(stmt.body.value.args[0], stmt.iter_vars[-1].var))
    if not blocked and cut_at_conditions(sch, block, loops, len(stmt.iter_vars) - len(loops), PARALLEL_MIN):
        return  # each row cut at the borders, its inside in vectors (flat.py)
    points = loop_extent(sch, inner)
    if blocked:
        *outer, column = outer
        points *= loop_extent(sch, column)
    fused = sch.fuse(*outer) if len(outer) > 1 else outer[0]
    if loop_extent(sch, fused) > 1 and loop_extent(sch, fused) * points >= PARALLEL_MIN:
        sch.parallel(fused)
    if blocked:
        _, lanes = sch.split(inner, [None, VECTOR])
        sch.vectorize(lanes)


RULES = {"gemm": _gemm, "conv": _conv, "reduction": schedule_reduction, "pad": _pad, "injective": _injective,
         "bf16_gemm": lambda sch, block: schedule_bf16_gemm(sch, block, fallback=schedule_reduction),
         "bf16_conv": lambda sch, block: schedule_bf16_conv(sch, block, fallback=schedule_reduction)}
