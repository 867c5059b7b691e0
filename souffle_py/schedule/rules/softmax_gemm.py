"""The softmax-GEMM chain rule: attention's large softmax computed under its context GEMM's row tiles
(softmax_gemms.py). The first chain rule: the blocks it takes are left out of the row chains."""

from __future__ import annotations

from souffle_py.cpu_target import CpuTarget
from souffle_py.schedule.rules.base import ChainRule
from souffle_py.schedule.softmax_gemms import schedule_softmax_gemms


class SoftmaxGemmChain(ChainRule):
    """Each GEMM whose operand is a large softmax chain's output, the chain under its row tiles."""

    name = "softmax GEMM"

    def schedule(self, sch, names, target: CpuTarget) -> set[str]:
        return schedule_softmax_gemms(sch, names)
