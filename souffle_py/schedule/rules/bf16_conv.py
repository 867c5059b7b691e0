"""The bfloat16 convolution rule: a convolution that te_passes/precision_conv.py converted (its mark), on
vdpbf16ps micro-kernel tiles (bf16_conv.py), a plain reduction where tensorize refuses them. Tried before
the float32 rules, which would take its block by its shape."""

from __future__ import annotations

from souffle_py.schedule.bf16_conv import schedule_bf16_conv
from souffle_py.schedule.reductions import schedule_reduction
from souffle_py.schedule.rules.base import BlockRule
from te_passes.precision_conv import BF16_CONV


def _tiles_or_reduction(sch, block) -> None:
    schedule_bf16_conv(sch, block, fallback=schedule_reduction)


class Bf16Conv(BlockRule):
    """A bf16 convolution: vdpbf16ps register tiles."""

    name = "bf16_conv"
    mark = BF16_CONV
    schedule = staticmethod(_tiles_or_reduction)
