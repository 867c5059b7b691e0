"""The bfloat16 GEMM rule: a GEMM that te_passes/precision.py converted, on vdpbf16ps micro-kernel tiles
(bf16_gemm.py), a plain reduction where tensorize refuses them. Tried first: its block is a GEMM by shape."""

from __future__ import annotations

from souffle_py.cpu_target import CpuTarget
from souffle_py.schedule.bf16_gemm import is_bf16_gemm, schedule_bf16_gemm
from souffle_py.schedule.reductions import schedule_reduction
from souffle_py.schedule.rules.base import ScheduleRule


class Bf16Gemm(ScheduleRule):
    """A bf16 GEMM (its annotation): vdpbf16ps register tiles."""

    name = "bf16_gemm"

    def applies(self, sch, block, target: CpuTarget) -> bool:
        return is_bf16_gemm(sch, block)

    def apply(self, sch, block, target: CpuTarget) -> None:
        schedule_bf16_gemm(sch, block, fallback=schedule_reduction)
