"""Default CPU schedules of reductions (softmax and layernorm rows, means, pools): parallel over the
outputs, the reduction in vector lanes of partial results (rfactor) along a contiguous axis, masked lanes
over a ragged run (flat.py), or one output per lane where only an output axis is contiguous. Also the
lanes of a reduction computed under another block's row loop (rules/row_chain.py)."""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx

from souffle_py.schedule.blocks import PARALLEL_MIN, block_kind, block_loops, lane_access, loop_extent, vector_lanes
from souffle_py.schedule.flat import ragged_reduction_lanes, vectorize_ragged_reduction


def schedule_reduction(sch, block) -> None:
    loops = block_loops(sch, block)
    stmt = sch.get(block)
    n_reduce = sum(1 for iv in stmt.iter_vars if int(iv.iter_type) == 2)
    n_spatial = len(loops) - n_reduce  # not counting a time loop outside
    spatial = loops[:n_spatial]
    if not spatial:
        return
    lanes = reduces_in_vector_lanes(sch, block, loops[n_spatial:])
    if not lanes and _reduce_in_output_lanes(sch, block, spatial, loops[n_spatial:]):
        return
    fused = sch.fuse(*spatial) if len(spatial) > 1 else spatial[0]
    total = loop_extent(sch, fused)
    for loop in loops[n_spatial:]:
        total *= loop_extent(sch, loop)
    if loop_extent(sch, fused) > 1 and total >= PARALLEL_MIN:  # before the rfactor, which splits off an init
        sch.parallel(fused)
    _reduce_in_lanes(sch, block, fused, loops[n_spatial:], lanes)


def reduce_under(sch, block, row) -> None:
    """The reduction `block` (still in loops of its own) computed under the loop `row` of a later block (a row
    chain's, rules/row_chain.py), in vector lanes as `_reduction` would run it."""
    n_reduce = sum(1 for iv in sch.get(block).iter_vars if int(iv.iter_type) == 2)
    reduce_loops = block_loops(sch, block)[-n_reduce:]
    lanes = reduces_in_vector_lanes(sch, block, reduce_loops)
    if not _reduce_in_lanes(sch, block, row, reduce_loops, lanes, place=True):
        sch.compute_at(block, row)


def _reduce_in_lanes(sch, block, row, reduce_loops, lanes: int, place: bool = False) -> bool:
    """Partial results in `lanes` vector lanes per `row`; a ragged row (197 softmax columns, a 7 x 7 pool; 196,
    4-lane vectors only: 13 masked ones, not 49) in masked vectors over its run (flat.py) instead, for a plain
    reduction, not a GEMM's fallback (a tuning trace has no predicate). `place`: the block moves under `row`
    too (it is a later block's). False where neither applies (nothing changed)."""
    narrow = 0 < lanes <= vector_lanes() // 4
    ragged = 0 if lanes and not narrow or block_kind(sch, block) != "reduction" else ragged_reduction_lanes(
        sch, block, reduce_loops)
    if ragged:
        vectorize_ragged_reduction(sch, block, row, reduce_loops, ragged, place)
    elif lanes:
        if narrow and place:  # a row chain's max, which TVM cannot mask: several vectors of partials
            lanes = wide_lanes(loop_extent(sch, reduce_loops[-1])) or lanes
        _vectorize_reduction(sch, block, row, reduce_loops[-1], lanes, place)
    return bool(ragged or lanes)


def wide_lanes(extent: int) -> int:
    """Partial results for a row only 4-lane vectors divide: the most (a multiple of 4, from 2 * vector_lanes() to
    4 * vector_lanes()) dividing it, which LLVM runs as several independent vectors; 0 if none. Whisper's softmax
    max over rows of 1500 in 4 lanes was one dependent chain of vmaxps: 7.9 ms over 6 x 1500 x 1500 alone,
    in 60 lanes 2.1 (its row sum, masked over 16 lanes: 2.1). Only under a row chain (rules/row_chain.py): as
    the default for every such reduction it coincided with PoolFormer-S12 running 0.88x, unexplained."""
    return next((w for w in range(4 * vector_lanes(), 2 * vector_lanes() - 1, -vector_lanes() // 4) if extent % w == 0), 0)


def reduces_in_vector_lanes(sch, block, reduce_loops) -> int:
    """Lanes of partial results the reduction can run in (0: none): vector_lanes(), or the widest power of two from
    4 up dividing the innermost reduction axis (a 56-wide row of a pooled NCHW map: 8), along which every
    load is contiguous or invariant (softmax and layernorm rows, global pools), with at least 2 * vector_lanes()
    terms. Only the innermost axis is split: a vector across rows would gather (see _injective)."""
    stmt = sch.get(block)
    reduce_vars = [iv for iv in stmt.iter_vars if int(iv.iter_type) == 2]
    if not reduce_loops or len(reduce_loops) != len(reduce_vars) or not isinstance(stmt.body, tirx.BufferStore):
        return 0
    extent, total = loop_extent(sch, reduce_loops[-1]), 1
    for loop in reduce_loops:
        total *= loop_extent(sch, loop)
    lanes = row_lanes(extent)
    if not lanes or extent < 2 * lanes or total < 2 * vector_lanes():
        return 0
    loads = []
    tvm_ffi.structural_walk(stmt.body.value, [(tvm.ir.expr.TensorLoad, loads.append)])
    var = reduce_vars[-1].var
    return lanes if loads and all(lane_access(load, var, lanes) != "gather" for load in loads) else 0


def _reduce_in_output_lanes(sch, block, spatial, reduce_loops) -> bool:
    """Reduce vector_lanes() (or 8 or 4) outputs at once, one per lane, where the reduction's own axes are strided but an
    output axis is contiguous in every read (a global pool over a channel-blocked map, te_passes/
    depthwise_blocks.py: [N, C / 16, H, W, 16] summed over H and W is 16 channels per vector load).
    False (nothing changed) where no output axis qualifies."""
    stmt = sch.get(block)
    spatial_vars = [iv for iv in stmt.iter_vars if int(iv.iter_type) == 0]
    if len(spatial_vars) != len(spatial) or not isinstance(stmt.body, tirx.BufferStore):
        return False
    loads = []
    tvm_ffi.structural_walk(stmt.body.value, [(tvm.ir.expr.TensorLoad, loads.append)])
    axis = max((i for i, iv in enumerate(spatial_vars) if int(iv.dom.extent) > 1), default=None)
    extent = int(spatial_vars[axis].dom.extent) if axis is not None else 0
    lanes = (_narrow_row(extent, stmt.body.buffer.dtype) or row_lanes(extent)) if extent else 0
    if lanes != vector_lanes():  # a narrower vector only where the data, not just the running sum, is contiguous
        loads = [load for load in loads if not load.source.same_as(stmt.body.buffer)]
    if not lanes or not loads:  # 16 lanes, or 8 / 4 where 16 does not divide the axis (a 3x3 window sum
        return False            # over 56-wide rows: PoolFormer's pooling, 0.5 ms per map in scalars)
    access = [lane_access(load, spatial_vars[axis].var, lanes) for load in loads]
    if "contiguous" not in access:  # gathers beside it (a bias read per pair, batch_lanes.py) still beat scalars
        return False
    outer, lane = sch.split(spatial[axis], [None, lanes])
    sch.reorder(*spatial[:axis], *spatial[axis + 1:], outer, *reduce_loops, lane)
    acc = sch.cache_write(block, 0, "local")
    sch.reverse_compute_at(acc, outer)
    sch.vectorize(lane)
    sch.vectorize(block_loops(sch, acc)[-1])
    fused = sch.fuse(*spatial[:axis], *spatial[axis + 1:], outer)
    total = loop_extent(sch, fused) * lanes
    for loop in reduce_loops:
        total *= loop_extent(sch, loop)
    if loop_extent(sch, fused) > 1 and total >= PARALLEL_MIN:
        sch.parallel(fused)
    sch.decompose_reduction(block, reduce_loops[0])
    return True


def _vectorize_reduction(sch, block, row, reduce_loop, lanes: int | None = None, place: bool = False) -> None:
    """rfactor the innermost reduction axis into `lanes` partial results per row (a vector register,
    accumulated over the other reduction axes and along the row), then reduce the lanes: ~1 element per
    lane per cycle instead of a scalar chain. `place`: the block moves under `row` too."""
    n_reduce = sum(1 for iv in sch.get(block).iter_vars if int(iv.iter_type) == 2)
    outer, lane = sch.split(reduce_loop, [None, lanes or vector_lanes()])
    ndim = len(sch.get(block).writes[0].region)
    partial = sch.rfactor(lane, factor_axis=ndim)
    sch.set_scope(partial, 0, "local")
    if place:
        sch.compute_at(block, row)
    sch.compute_at(partial, row)
    p_lane, *p_reduce = sch.get_loops(partial)[-(n_reduce + 1):]  # compute_at: iter-var order, lane first
    sch.reorder(*p_reduce, p_lane)
    sch.vectorize(p_lane)
    init = sch.decompose_reduction(partial, p_reduce[0])
    sch.vectorize(sch.get_loops(init)[-1])


def _narrow_row(extent: int, dtype) -> int:
    """A row of 8- or 16-bit outputs in one vector where it fits (a multiple of 4 elements), else in the
    widest such part of it that fills more than a float32 vector's lanes (56 int8 values: one 512-bit
    vector, two 28-byte halves of 256-bit ones), else 0: an int8 max pool's 56-wide rows (te_passes/
    int8_pool.py; ResNet's stem pool before it ran channels-last) ran 8 lanes, an eighth of a 512-bit
    vector, in 25088 parallel tasks."""
    bits = tvm.runtime.DataType(str(dtype)).bits
    if bits >= 32:
        return 0
    fits = [d for d in range(4, extent + 1, 4) if extent % d == 0 and d * bits <= vector_lanes() * 32]
    return max(fits) if fits and max(fits) > vector_lanes() else 0


def row_lanes(extent: int) -> int:
    """Vector lanes for a row of `extent` elements: vector_lanes() if it divides the row, else the widest power of
    two from 4 up that does; 0 when none does."""
    if extent % vector_lanes() == 0:
        return vector_lanes()
    return next((w for w in (vector_lanes() // 2, vector_lanes() // 4) if w >= 4 and extent % w == 0), 0)
