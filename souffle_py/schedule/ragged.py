"""Register tiles for extents nothing divides: a prime number of tokens (197, ViT), a map 71 or 17 wide
(Inception), any channel or key count a user's model has. Without these the rules fell back to one-row or
one-column tiles: 2 of 32 registers accumulating, 2-5 GFLOP/s, 3-17x ONNX Runtime's latency.

- Rows (an unrolled axis): tiles of balanced size, the last one masked by the split's predicate; the
  predicate is invariant over the reduction, so the tile still runs as whole vector FMAs. A conv's loop
  over such tiles is marked (LAST_TILE_APART) and `last_tiles_apart` gives its last tile a copy of the loop
  body of its own, where the predicate is constant: left varying inside the reduction, LLVM kept a
  half-masked tile's partial sums on the stack (32 -> 32 3x3 at 147 x 147: 96 GFLOP/s; apart, 165).
- Columns (the vector axis): a masked vector would be built lane by lane, so the GEMM's iteration domain
  is padded to whole tiles instead (TVM's `pad_einsum`): the operands are copied once, zero-padded, and
  the padded tile's write-back stores only the real rows and columns.
"""

from __future__ import annotations

import logging

import tvm_ffi
from tvm import s_tir, tirx

from souffle_py.failures import not_applied
from souffle_py.schedule.blocks import vector_lanes, block_loops, has_annotated_loop, loop_extent
from souffle_py.schedule.flat import when_scheduled
from souffle_py.schedule.thresholds import RAGGED_TILE_GAIN
from souffle_py.ir.exprs import substitute

log = logging.getLogger(__name__)

LAST_TILE_APART = "souffle_last_tile_apart"


def tile_rows(extent: int, most: int) -> tuple[int, float]:
    """(rows per tile, useful rows per tile on average) for an axis of `extent` in tiles of at most `most`:
    the largest divisor, unless balanced tiles with a masked last one compute RAGGED_TILE_GAIN times more
    (71 in tiles of at most 14: 12, six tiles, against 1)."""
    most = max(1, min(most, extent))
    divisor = max(r for r in range(1, most + 1) if extent % r == 0)
    tiles = -(-extent // most)
    if extent / tiles > RAGGED_TILE_GAIN * divisor:
        return -(-extent // tiles), extent / tiles
    return divisor, float(divisor)


def pad_to_tiles(sch: s_tir.Schedule, block, tile_i: int, tile_j: int):
    """Pad the GEMM `block`'s row and column axes (its loops: outer..., rows, columns, k) up to multiples
    of `tile_i` and `tile_j`: afterwards the block computes whole tiles over zero-padded copies of its
    operands (rows are padded too: a masked row tile's write-back loses its row predicate when the copy
    below is folded into it).
    An operand read at a computed index (a head's Q sliced out of a fused QKV projection, which pad_einsum
    refuses) is first copied to the block's own indices (TVM's reindex), a copy the padded one then absorbs:
    Whisper's 1500 x 1500 attention scores, one column per step before, 16 GFLOP/s.
    Returns the block that copies the padded result to the real output (for `inline_output_copy` once the
    schedule has its write-back), or None where TVM's pad_einsum refuses the block (its operands then
    copied, in vectors, where they were reindexed)."""
    loops = block_loops(sch, block)
    padding = [1] * len(loops)
    padding[-3] = tile_i if loop_extent(sch, loops[-3]) % tile_i else 1
    padding[-2] = tile_j if loop_extent(sch, loops[-2]) % tile_j else 1
    if len(sch.get_loops(block)) != len(loops):
        return None  # inside a recurrence's time loop
    reindexed = []
    try:
        reindexed = _reindex_computed_reads(sch, block)
        sch.pad_einsum(block, padding)
    except Exception as exc:  # noqa: BLE001  (tvm ScheduleError: pad_einsum changed nothing)
        not_applied("ragged tile padding", sch.get(block).name_hint, exc, "its columns unpadded")
        for copy in reindexed:
            _vectorize_copy(sch, copy)
        return None
    for copy in reindexed:  # the padded copy reads the operand itself
        sch.compute_inline(copy)
    for producer in sch.get_producers(block):
        _vectorize_copy(sch, producer)
    consumers = sch.get_consumers(block)
    return consumers[0] if len(consumers) == 1 else None


def _reindex_computed_reads(sch: s_tir.Schedule, block) -> list:
    """Copy each operand of `block` read at an index that is not one of its iteration variables into a
    buffer indexed by them (TVM's reindex); returns the copies."""
    stmt = sch.get(block)
    computed = [n for n, region in enumerate(stmt.reads)
                if any(not isinstance(r.min, tirx.Var) and not _is_zero(r.min) for r in region.region)]
    copies = []
    for n in reversed(computed):  # reindex renumbers the reads after n
        copies.append(sch.reindex(block, ("read", n)))
    return copies


def _is_zero(expr) -> bool:
    return isinstance(expr, tirx.IntImm) and expr.value == 0


PENDING_FOLD = "souffle.pending_fold"  # a padded result's copy that inline_output_copy folds when the rules are done


def inline_output_copy(sch: s_tir.Schedule, copy, now: bool = False) -> None:
    """Fold the padded result's copy into the tile write-back that precedes it (a store of the real
    columns only); a vectorized copy of its own where TVM refuses. Once every rule has run (flat.py
    `when_scheduled`; `now`: at once, a trial schedule's): the write-back's predicated store leaves the
    scope no stage pipeline, and each later block's compute_at failed."""
    if copy is None:
        return
    name = sch.get(copy).name_hint

    def fold():
        block = sch.get_sblock(name)
        try:
            sch.reverse_compute_inline(block)
        except Exception as exc:  # noqa: BLE001  (tvm ScheduleError: nothing changed)
            not_applied("padded output inlining", name, exc, "a vectorized copy of its own")
            _vectorize_copy(sch, block)
    if now:
        fold()
    else:
        sch.annotate(copy, PENDING_FOLD, 1)  # an epilogue fusion into the write-back waits for it (epilogue.py)
        when_scheduled(name, fold, "padded output inlining", "a copy of its own", before_partitions=True)


def _vectorize_copy(sch: s_tir.Schedule, block) -> None:
    inner = sch.get_loops(block)[-1]
    extent = loop_extent(sch, inner)
    if extent % vector_lanes() == 0:
        sch.vectorize(sch.split(inner, [None, vector_lanes()])[1])


def last_tiles_apart(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` (scheduled) with each loop marked LAST_TILE_APART cut before its last iteration, which runs as
    a copy of the body with the loop variable replaced by its last value (TVM's loop_partition crashes on a
    loop holding a conv's init, update and write-back blocks); values unchanged."""
    if not has_annotated_loop(func, LAST_TILE_APART):
        return func

    def cut(loop):
        if LAST_TILE_APART not in loop.annotations:
            return loop
        rest = {k: v for k, v in loop.annotations.items() if k != LAST_TILE_APART}
        last = loop.min + loop.extent - 1
        head = tirx.For(loop.loop_var, loop.min, loop.extent - 1, loop.kind, loop.body, loop.thread_binding, rest)
        return tirx.SeqStmt([head, substitute(loop.body, {loop.loop_var.__chandle__(): last})])
    return func.with_body(tvm_ffi.structural_map(func.body, [(tirx.For, cut)]))
