"""The cell update rule: an LSTM/GRU step's elementwise cell update (marked by te_passes/gate_projections.py)
split by the groups of units of its gate projection (rules/gate_projection.py), so that a thread updates the
units whose gates it computed (gates.py). Tried before the injective rule, which takes the updates this rule
cannot group."""

from __future__ import annotations

from souffle_py.schedule.blocks import block_loops, loop_extent, vector_lanes
from souffle_py.schedule.gates import group_units
from souffle_py.schedule.rules.base import BlockRule
from souffle_py.ir.marks import GATE_BLOCKS, GATE_CELL


def cell_update(sch, block) -> bool:
    """Schedule a marked cell update (elementwise over [outer..., units]) by the groups of its gate
    projection, the outer loops fused with the groups as the projection's are; False (nothing changed)
    where it does not have that form."""
    projections = [p for p in sch.get_producers(block) if GATE_BLOCKS in sch.get(p).annotations]
    loops = block_loops(sch, block)
    if len(projections) != 1 or not loops:
        return False
    gates = int(sch.get(projections[0]).annotations[GATE_BLOCKS])
    per_group = group_units(loop_extent(sch, loops[-1]), gates)
    if not per_group:
        return False
    group, unit = sch.split(loops[-1], [None, per_group])
    _, lane = sch.split(unit, [None, vector_lanes()])
    sch.vectorize(lane)
    sch.parallel(sch.fuse(*loops[:-1], group) if len(loops) > 1 else group)
    return True


class CellUpdate(BlockRule):
    """A marked cell update: split by its projection's groups of units, groups in parallel."""

    name = "cell update"
    kind = "injective"
    mark = GATE_CELL
    schedule = staticmethod(cell_update)
