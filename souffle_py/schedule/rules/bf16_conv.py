"""The bfloat16 convolution rule: a convolution that te_passes/precision_conv.py converted, on vdpbf16ps
micro-kernel tiles (bf16_conv.py), a plain reduction where tensorize refuses them. Tried before the float32
rules: its block is a conv by shape."""

from __future__ import annotations

from souffle_py.cpu_target import CpuTarget
from souffle_py.schedule.bf16_conv import is_bf16_conv, schedule_bf16_conv
from souffle_py.schedule.reductions import schedule_reduction
from souffle_py.schedule.rules.base import ScheduleRule


class Bf16Conv(ScheduleRule):
    """A bf16 convolution (its annotation): vdpbf16ps register tiles."""

    name = "bf16_conv"

    def applies(self, sch, block, target: CpuTarget) -> bool:
        return is_bf16_conv(sch, block)

    def apply(self, sch, block, target: CpuTarget) -> None:
        schedule_bf16_conv(sch, block, fallback=schedule_reduction)
