"""The reduction rule (softmax and LayerNorm rows, means, pools: a reduction that is no GEMM or conv):
parallel over the outputs, the reduction in vector lanes (reductions.py, which the GEMM, conv and row
chain rules use too)."""

from __future__ import annotations

from souffle_py.schedule.reductions import schedule_reduction
from souffle_py.schedule.rules.base import BlockRule


class Reduction(BlockRule):
    """Outputs in parallel, the reduction innermost in vector lanes of partial results."""

    name = "reduction"
    kind = "reduction"
    schedule = staticmethod(schedule_reduction)
