"""The int8 GEMM rule: an integer GEMM that te_passes/int8_gemm.py put in vpdpbusd's form (its mark, with
16 lanes), on VNNI micro-kernel tiles (schedule/int8_gemm.py), a plain reduction where tensorize refuses
them. Tried first: its block is a reduction by shape, which the reduction rule would take."""

from __future__ import annotations

from souffle_py.schedule.int8_gemm import is_vnni_gemm, schedule_vnni_gemm
from souffle_py.schedule.reductions import schedule_reduction
from souffle_py.schedule.rules.base import BlockRule
from te_passes.int8_gemm import INT8_GEMM


class VnniGemm(BlockRule):
    """An int8 GEMM in vpdpbusd's form: VNNI register tiles."""

    name, mark = "vnni_gemm", INT8_GEMM

    def applies(self, sch, block, target) -> bool:
        return is_vnni_gemm(sch, block)

    @staticmethod
    def schedule(sch, block) -> None:
        schedule_vnni_gemm(sch, block, fallback=schedule_reduction)
