"""The bfloat16 GEMM rule: a GEMM that te_passes/precision.py converted (its mark), on vdpbf16ps
micro-kernel tiles (bf16_gemm.py), a plain reduction where tensorize refuses them. Tried first: its block
is a reduction by shape (its operands widened by calls), which the reduction rule would take."""

from __future__ import annotations

from souffle_py.schedule.bf16_gemm import schedule_bf16_gemm
from souffle_py.schedule.rules.base import BlockRule
from souffle_py.ir.marks import BF16_GEMM


class Bf16Gemm(BlockRule):
    """A bf16 GEMM: vdpbf16ps register tiles."""

    name, mark, schedule = "bf16_gemm", BF16_GEMM, staticmethod(schedule_bf16_gemm)
