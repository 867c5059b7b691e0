"""The GEMM rule (GEMM-like: one reduction axis, two or more spatial axes, a product of two loads): register
tiles of gemm_tile_rows() x gemm_tile_columns() accumulated in a local buffer, the j tile vectorized, outer
tiles parallel; weights packed in panels (te_passes/layout.py) fix the tile's columns and are walked in
column chunks that fit in L2, streamed in pieces where the GEMM has few rows (streaming.py); a one-row
GEMV whose columns would not vectorize becomes dot products in vector lanes (reductions.py).

The register tile: rows x two vectors of columns of accumulators where the rows allow (BERT's 128 x 768 x
768: 8 x 32 ~350-460 GFLOP/s here, 4 x 64 ~280, 8 x 64 spills). Other shapes fill up to
gemm_accumulators() vector registers (AVX-512 has 32: 20 accumulators leave room for the weight vectors
and the broadcast row value; AVX2 has 16).
"""

from __future__ import annotations

import logging

from tvm import tirx

from souffle_py.schedule.blocks import (
    block_loops, columns_gather, gathered_column_loads, loop_extent, uses, vector_lanes, weight_panel,
)
from souffle_py.schedule.budgets import gemm_accumulators, gemm_tile_columns, gemm_tile_rows
from souffle_py.schedule.conv import VARIANT
from souffle_py.schedule.epilogue import fuse_elementwise_epilogue
from souffle_py.schedule.ragged import RAGGED_TILE_GAIN, inline_output_copy, pad_to_tiles, tile_rows
from souffle_py.schedule.reductions import reduces_in_vector_lanes, schedule_reduction
from souffle_py.schedule.rules.base import BlockRule
from souffle_py.schedule.rules.injective import schedule_injective
from souffle_py.schedule.streaming import AT, L2_CHUNK_BYTES, PIECE, stream_piece
from souffle_py.schedule.thresholds import STREAM_GEMM_ROWS

log = logging.getLogger(__name__)

GEMM_EPILOGUE = True  # a GEMM's elementwise reader runs in its write-back (epilogue.py): Swin-B's
                     # QKV bias add, 1.5% of the model; BERT, ViT, GPT-2, DeiT, LeViT, Whisper within +-1%


def register_tile(rows: int, cols: int, masked_columns: bool = True) -> tuple[int, int]:
    """(tile_i, tile_j): the GEMM register tile; a masked last row tile only where no divisor of the rows
    fits (ragged.tile_rows), whole vectors over padded columns where no vector divides them (unless not
    `masked_columns`: no padded copy could be made, and 4- or 8-lane part vectors that divide them are
    taken, Visformer's 196 keys). gemm_tile_rows() x gemm_tile_columns() where the shape allows; otherwise the most accumulator lanes within
    gemm_accumulators() vectors, ties to more rows (each row shares the loaded weight vectors), at least min(rows, 4)
    rows, and tile_j a power-of-two number of vectors (LLVM scalarizes a 48-lane vector: ~16 GFLOP/s). 100
    rows: 5 x 64 (~365 GFLOP/s on an LSTM's 100x1024x256; 5 x 32 ~210, 4 x 64 ~300); 49 rows: 7 x 32; a GEMV
    (one row): 1 x 256, whose 16 independent accumulator chains hide the FMA latency (1 x 32 made an LSTM step
    ~3x slower)."""
    lanes, most_rows, most_columns = vector_lanes(), gemm_tile_rows(), gemm_tile_columns()
    budget = gemm_accumulators() * lanes  # accumulator lanes
    if rows % most_rows == 0 and cols % most_columns == 0:
        return most_rows, most_columns
    widths = [lanes << n for n in range(8) if lanes << n <= budget]
    if not masked_columns:  # no padded copy: part vectors (4 or 8 lanes) over columns no vector divides
        widths = [w for w in (4, 8) if w < lanes] + widths

    def columns(tile_i: int) -> int:  # the widest vector tile dividing the columns within the registers
        return next((w for w in reversed(widths) if w <= budget // tile_i and cols % w == 0), 1)
    best, best_lanes = (1, 1), 0
    for tile_i in range(min(rows, most_rows), 0, -1):
        if rows % tile_i or tile_i < min(rows, 4):
            continue
        tile_j = columns(tile_i)
        if tile_i * tile_j > best_lanes:
            best, best_lanes = (tile_i, tile_j), tile_i * tile_j
    tile_i, tile_j = best
    ragged, useful = tile_rows(rows, most_rows)
    if rows % ragged and tile_i < min(rows, 4) and useful > RAGGED_TILE_GAIN * tile_i:
        tile_i = ragged  # 197 tokens (ViT, DeiT), a prime: 1 x 1 tiles before, 2.4 GFLOP/s
        tile_j = columns(tile_i)
    if masked_columns and tile_j < lanes <= cols and rows > 1:  # no vector divides the columns (197 keys):
        # whole vector tiles over columns padded up to them (ragged.pad_to_tiles)
        tile_j = most_columns if cols >= most_columns and tile_i * most_columns <= budget else lanes
    return tile_i, tile_j


def schedule_gemm(sch, block) -> None:
    """The register-tiled GEMM (module docstring) of `block`."""
    _merge_column_axes(sch, block)
    _pack_gathered_columns(sch, block)
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
        fuse_elementwise_epilogue(sch, write_back)


def _merge_column_axes(sch, block) -> None:
    """Fuse the spatial loops that end the block and index only the weights (the operand the last one
    indexes) into one column loop, when an outer loop indexes only the other operand (the real rows). An
    einsum 'td,dnh->tnh' (Funnel's relative-position projection, 256 x 768 x (12 x 64)) otherwise took the
    heads n as its rows: each t streamed the whole 2.4 MB weight for a 4 x 64 tile (45 GFLOP/s)."""
    stmt = sch.get(block)
    spatial = [iv.var for iv in stmt.iter_vars if int(iv.iter_type) == 0]
    product = stmt.body.value.b
    weights = [x for x in (product.a, product.b) if uses(x, spatial[-1])]
    if len(weights) != 1:
        return
    weight = weights[0]
    other = product.b if weight.same_as(product.a) else product.a
    run = 0
    while run < len(spatial) and uses(weight, spatial[-1 - run]) and not uses(other, spatial[-1 - run]):
        run += 1
    if run < 2 or not any(uses(other, v) and not uses(weight, v) for v in spatial[:-run]):
        return
    loops = block_loops(sch, block)
    sch.fuse(*loops[len(spatial) - run:len(spatial)])


def _pack_gathered_columns(sch, block) -> None:
    """Copy the operand that a vector of columns would gather into a layout where the axes the column
    indexes are one innermost axis, when the GEMM has rows (a GEMV reduces in vector lanes instead).
    Attention over a conv's channel blocks (Visformer: K^T[d, m] = X[c // 32, m // 14, m % 14, c % 32])
    read every key 32 floats apart: Q K^T at 15 GFLOP/s (0.96 ms of a 16.7 ms model); the copy is one pass
    over the map."""
    stmt = sch.get(block)
    spatial = [iv for iv in stmt.iter_vars if int(iv.iter_type) == 0]
    column, rows = spatial[-1].var, int(spatial[-2].dom.extent) if len(spatial) > 1 else 1
    loads = gathered_column_loads(sch, block)
    if rows < vector_lanes() or len(loads) != 1 or weight_panel(sch, block) is not None:
        return
    buffer = loads[0].source
    across = [d for d, index in enumerate(loads[0].indices) if uses(index, column)]
    if not across or any(uses(loads[0].indices[d], iv.var) for d in across for iv in spatial[:-1]):
        return
    shape = [int(n) for n in buffer.shape]
    others = [d for d in range(len(shape)) if d not in across]
    read = next(n for n, region in enumerate(stmt.reads) if region.source.same_as(buffer))

    def packed(*idx):
        flat = 0
        for d in across:
            flat = flat * shape[d] + idx[d]
        return [idx[d] for d in others] + [flat]
    layout = tirx.IndexMap.from_func(packed, ndim=len(shape))
    copy = sch.cache_read(block, read, "global")
    sch.transform_layout(copy, ("write", 0), packed)
    sch.transform_block_layout(copy, layout)
    schedule_injective(sch, copy)
    log.debug("%s reads %s packed with its column axes innermost", stmt.name_hint, buffer.name)


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
        outer, shared = outer[:len(outer) - shared], 0
    # rows sharing the weights that stay outer loops (BERT at batch 2 x 13 tokens: a 7-row tile does not
    # divide 13) run inside the weights' column chunks, so that a chunk serves them all from L2: outermost,
    # the parallel loop gave each core one batch, and both cores streamed every weight (2 x 13 tokens ran
    # at 1.47x ONNX Runtime, 1 x 26 at 1.0x)
    outer, beside = (outer[:len(outer) - shared], outer[len(outer) - shared:]) if shared else (outer, [])
    tile_i, tile_j = register_tile(loop_extent(sch, i), cols, masked_columns)
    if not panel and (tile_j < vector_lanes() or columns_gather(sch, block)) and loop_extent(sch, i) == 1 \
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
        rows = loop_extent(sch, io) * tile_i  # few (BERT's 128): each panel is reused by few row tiles
        for loop in beside:
            rows *= loop_extent(sch, loop)
        streamed = rows <= STREAM_GEMM_ROWS and VARIANT.get().stream
        if streamed:
            # streamed, a chunk keeps only a piece of its panels in L2 (and its output): as many panels as
            # `stream_piece` takes, so each row tile's inputs serve that many panels while in L1 (BERT's
            # 128 x 3072 x 768 in 1 panel per chunk: 2.6 ms in the model, ONNX Runtime 2.0)
            per = max([per] + [d for d in range(per + 1, tiles + 1) if tiles % d == 0 and stream_piece(
                loop_extent(sch, k), tiles // d, rows * d * tile_j * 4)])
        chunk, jo = sch.split(jo, [None, per])
        chunks = [chunk]
        if streamed:
            piece = stream_piece(loop_extent(sch, k), loop_extent(sch, chunk), rows * per * tile_j * 4)
    if piece:
        log.debug("%s streams its weight panels in pieces of %d", sch.get(block).name_hint, piece)
        piece_loop, k = sch.split(k, [None, piece])
        sch.reorder(*outer, chunk, piece_loop, *beside, io, jo, k, ii, ji)
    else:
        sch.reorder(*outer, *chunks, *beside, io, jo, k, ii, ji)
    acc = sch.cache_write(block, 0, "local")
    sch.reverse_compute_at(acc, chunk if piece else jo)
    # loop annotations first: parallel/vectorize refuse a reduction block whose init was split off
    if tile_j >= min(4, vector_lanes()):  # part vectors only where no padded copy was made (register_tile)
        sch.vectorize(ji)
        sch.vectorize(block_loops(sch, acc)[-1])
    sch.unroll(ii)
    if piece:
        sch.parallel(sch.fuse(*outer, chunk) if outer else chunk)
        sch.annotate(piece_loop, PIECE, piece * tile_j)
        sch.annotate(k, AT, weight.source.name)
        sch.decompose_reduction(block, piece_loop)
        return acc
    outer_fused = sch.fuse(*outer, *chunks, *beside, io, jo)
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


class GemmPanel(BlockRule):
    """Register tiles over rows and (panel) columns, accumulators in registers (module docstring)."""

    name = "gemm"
    kind = "gemm"
    schedule = staticmethod(schedule_gemm)
