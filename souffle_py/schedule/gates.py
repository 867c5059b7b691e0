"""An LSTM step on the CPU by groups of hidden units: each thread computes all gates of its own units and
then their cell updates, so a step meets at one barrier (CPU).

te_passes/gate_projections.py marks a recurrence's gate projection (its last axis G blocks of H units)
and the cell updates that read only their own unit's gates. The default GEMV tiles the G * H columns in
runs of 256, one gate per run, so a cell update needed every thread's gates: a barrier between the GEMV
and the updates. Here the projection is tiled by groups of U units, all G gates of a group in one
register tile (G x U accumulators, as many lanes as the default's 1 x 256), and the updates by the same
groups (rules/gate_projection.py, rules/cell_update.py); one_parallel_region (threads.py) then merges the
two group loops into one parallel loop (merge_groups, here). The 10 x 100 LSTM with one barrier per step
instead of two: 4-6% faster (10.78 -> 10.13 ms, in-process A/B).
"""

from __future__ import annotations

from souffle_py.schedule.blocks import block_loops, loop_extent, vector_lanes
from souffle_py.schedule.budgets import gemv_tile_lanes
from souffle_py.ir.marks import GATE_BLOCKS, GATE_CELL


def group_units(units: int, gates: int) -> int:
    """Units per group: the most whose G gates fit a group's tile of accumulators (the default GEMV's,
    budgets.gemv_tile_lanes), a multiple of the vector's lanes dividing H; 0 if none."""
    lanes, tile = vector_lanes(), gemv_tile_lanes()
    return max((u for u in range(lanes, units + 1, lanes) if units % u == 0 and gates * u <= tile), default=0)


def merge_groups(sch, blocks) -> None:
    """Merge the group loop of the scheduled gate projection in `blocks` (a step's, in order) with that of
    its cell updates, once those share one loop (threads.py merges them first): a unit's gates and its
    cell update then run in the same iteration, on the same thread."""
    projection = [_group_loop(sch, b) for b in blocks if GATE_BLOCKS in sch.get(b).annotations]
    cells = [_group_loop(sch, b) for b in blocks if GATE_CELL in sch.get(b).annotations]
    if not projection or not cells or None in projection + cells:
        return
    if not all(sch.get(loop).same_as(sch.get(projection[0])) for loop in projection) or \
            not all(sch.get(loop).same_as(sch.get(cells[0])) for loop in cells):
        return  # the projection's blocks (init, update) or the cell updates are not under one loop each
    if loop_extent(sch, projection[0]) != loop_extent(sch, cells[0]):
        return
    sch.parallel(sch.merge(projection[0], cells[0]))
    for block in blocks:
        stmt = sch.get(block)
        if GATE_BLOCKS in stmt.annotations and stmt.init is not None:  # the update: its init before its k loop
            sch.decompose_reduction(block, block_loops(sch, block)[1])


def _group_loop(sch, block):
    loops = block_loops(sch, block)
    return loops[0] if loops else None
