"""The padding rule (an injective block storing if_then_else(inside, x[...], constant), topi's pad and
dilate): rows in parallel, each row cut at the borders into plain loops (flat.py); vectorizing a
lane-dependent condition would scalarize the whole fused loop."""

from __future__ import annotations

from souffle_py.schedule.blocks import PARALLEL_MIN, block_loops, loop_extent, uses, vector_lanes
from souffle_py.schedule.flat import cut_at_conditions
from souffle_py.schedule.rules.base import BlockRule


def schedule_pad(sch, block) -> None:
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
    blocked = (loop_extent(sch, inner) % vector_lanes() == 0 and len(stmt.iter_vars) == len(loops) and len(outer) >= 2
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
        _, lanes = sch.split(inner, [None, vector_lanes()])
        sch.vectorize(lanes)


class Padding(BlockRule):
    """A padded copy: rows in parallel, each cut at its borders (or vectorized where the condition does not
    depend on the vector's axis)."""

    name = "pad"
    kind = "pad"
    schedule = staticmethod(schedule_pad)
