"""The bfloat16 convolution rule: a convolution that te_passes/precision_conv.py converted (its mark), on
vdpbf16ps micro-kernel tiles (bf16_conv.py), a plain reduction where tensorize refuses them. Tried before
the float32 rules, which would take its block by its shape."""

from __future__ import annotations

from souffle_py.schedule.bf16_conv import schedule_bf16_conv
from souffle_py.schedule.rules.base import BlockRule
from te_passes.precision_conv import BF16_CONV


class Bf16Conv(BlockRule):
    """A bf16 convolution: vdpbf16ps register tiles."""

    name, mark, schedule = "bf16_conv", BF16_CONV, staticmethod(schedule_bf16_conv)
