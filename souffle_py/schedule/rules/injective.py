"""The injective rule (elementwise, broadcast, reshape, transpose...): all loops fused, parallel and
vectorized; where no vector width divides the row, or a condition runs along it, over the flattened
contiguous axes with a masked tail (flat.py); a row of stacked maps selected by comparisons with constants
in its uniform pieces (pieces.py)."""

from __future__ import annotations

from souffle_py.schedule.blocks import (
    PARALLEL_MIN, block_loops, has_condition, loop_extent, stores_bool, vector_lanes,
)
from souffle_py.schedule.flat import vectorize_injective
from souffle_py.schedule.pieces import vectorize_pieces
from souffle_py.schedule.reductions import row_lanes
from souffle_py.schedule.rules.base import BlockRule


def schedule_injective(sch, block) -> None:
    """All loops fused, parallel, and vectorized within the innermost axis (of extent > 1): vector_lanes() lanes
    where they divide it, else the widest power of two (at least 4) that does. A vector across rows (56
    columns of an NCHW map) gathers and scatters element by element: TVM flattens the buffers after
    simplifying, so (f // 196) * 3136 + (f % 196 * 16 + l) // 56 * 56 + (f * 16 + l) % 56 stays per-lane
    arithmetic (BN + SiLU over 144 x 56 x 56: 0.48 ms, a numpy copy of it 0.13 ms)."""
    stmt = sch.get(block)
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
    if (lanes != vector_lanes() or not row_vector) and not stores_bool(sch, block) and vectorize_injective(
            sch, block, loops, time_axes, PARALLEL_MIN):
        return
    if not row_vector and not stores_bool(sch, block) and vectorize_pieces(sch, block, loops, time_axes, PARALLEL_MIN):
        return  # a row of stacked maps selected by constants: vectors within its uniform pieces (pieces.py)
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


class Injective(BlockRule):
    """Every block without a reduction that stores no padding: one parallel, vectorized loop."""

    name = "injective"
    kind = "injective"
    schedule = staticmethod(schedule_injective)
