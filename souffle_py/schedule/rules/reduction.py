"""The reduction rule (softmax and LayerNorm rows, means, pools: a reduction that is no GEMM or conv):
parallel over the outputs, the reduction in vector lanes (reductions.py, which the GEMM, conv and row
chain rules use too)."""

from __future__ import annotations

from souffle_py.cpu_target import CpuTarget
from souffle_py.schedule.blocks import block_kind
from souffle_py.schedule.reductions import schedule_reduction
from souffle_py.schedule.rules.base import ScheduleRule


class Reduction(ScheduleRule):
    """Outputs in parallel, the reduction innermost in vector lanes of partial results."""

    name = "reduction"

    def applies(self, sch, block, target: CpuTarget) -> bool:
        return block_kind(sch, block) == "reduction"

    def apply(self, sch, block, target: CpuTarget) -> None:
        schedule_reduction(sch, block)
