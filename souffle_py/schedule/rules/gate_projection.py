"""The gate projection rule: an LSTM/GRU step's gate GEMM stored by groups of hidden units
(te_passes/gate_projections.py) tiled by those groups, all gates of a group in one register tile, so that
each thread then runs its own units' cell updates (gates.py explains why). Tried before the GEMM rule,
which takes the projections this rule finds in another form."""

from __future__ import annotations

from souffle_py.schedule.blocks import block_loops, loop_extent, vector_lanes
from souffle_py.schedule.rules.base import BlockRule
from souffle_py.ir.marks import GATE_BLOCKS


def gate_projection(sch, block) -> bool:
    """Schedule a gate projection stored by groups (te_passes/gate_projections.py: loops [outer..., group,
    gate, unit, k], outer the direction and batch axes): a group's gates in one register tile, the outer
    loops and the groups shared out as one parallel loop; False (nothing changed) where it does not have
    that form."""
    loops = block_loops(sch, block)
    if len(loops) < 4:
        return False
    *outer, group, gate, unit, k = loops  # outer: a bidirectional node's direction, the batch
    if loop_extent(sch, unit) % vector_lanes():
        return False
    sch.reorder(*outer, group, k, gate, unit)
    acc = sch.cache_write(block, 0, "local")
    sch.reverse_compute_at(acc, group)
    sch.annotate(acc, GATE_BLOCKS, loop_extent(sch, gate))  # the write-back is what the cell updates read
    sch.vectorize(unit)
    sch.unroll(gate)
    sch.vectorize(block_loops(sch, acc)[-1])
    sch.parallel(sch.fuse(*outer, group) if outer else group)
    return True  # the init stays in the block until merge_groups: parallel() refuses a split-off init


class GateProjection(BlockRule):
    """A marked gate projection: one register tile of all gates per group of units, groups in parallel."""

    name = "gate projection"
    kind = "gemm"
    mark = GATE_BLOCKS
    schedule = staticmethod(gate_projection)
