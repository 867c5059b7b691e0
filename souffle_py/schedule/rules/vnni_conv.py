"""The int8 convolution rule: an integer convolution that te_passes/int8_conv_vnni.py put in vpdpbusd's form
(its mark, with 16 lanes), on VNNI micro-kernel tiles (schedule/int8_conv.py), a plain reduction where
tensorize refuses them. Tried before the conv rule, which would take its block by its shape."""

from __future__ import annotations

from souffle_py.schedule.int8_conv import is_vnni_conv, schedule_vnni_conv
from souffle_py.schedule.rules.base import BlockRule
from te_passes.int8_conv_vnni import INT8_CONV


class VnniConv(BlockRule):
    """An int8 convolution in vpdpbusd's form: VNNI register tiles."""

    name, mark = "vnni_conv", INT8_CONV

    def applies(self, sch, block, target) -> bool:
        return is_vnni_conv(sch, block)

    @staticmethod
    def schedule(sch, block) -> None:
        schedule_vnni_conv(sch, block)
