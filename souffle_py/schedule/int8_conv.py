"""The CPU's int8 convolution micro-kernel: the int8 GEMM's `vpdpbusd` tensor intrinsic (int8_gemm.py) on
the bf16 convolution's tiles (bf16_conv.py: a row of output pixels x one or two vectors of 16 output
channels, input channels and taps outside it), over the convolutions te_passes/int8_conv_vnni.py put in
vpdpbusd's form: four input channels per lane instead of two. The accumulators are written back once per
tile through the convolution's elementwise epilogue (its compensation and scales, or its requantization).
"""

from __future__ import annotations

from tvm import s_tir

from souffle_py.schedule.bf16_conv import DotConv, schedule_dot_conv
from souffle_py.schedule.epilogue import fuse_elementwise_epilogue
from souffle_py.schedule.int8_gemm import LANES, finish_vnni_tiles
from souffle_py.schedule.int8_pixel_conv import is_pixel_conv, schedule_pixel_conv
from te_passes.int8_conv_vnni import INT8_CONV
from te_passes.int8_gemm import VNNI_DEPTH

VNNI_CONV = DotConv("int8", "vpdpbusd", VNNI_DEPTH, 1, finish_vnni_tiles)


def is_vnni_conv(sch: s_tir.Schedule, block) -> bool:
    """Whether the block is an integer convolution in vpdpbusd's form (int8_conv_vnni.py's mark)."""
    value = sch.get(block).annotations.get(INT8_CONV)
    return value is not None and int(value) == LANES


def schedule_vnni_conv(sch: s_tir.Schedule, block) -> None:
    """The VNNI tiles (module docstring; a 1 x 1 convolution with its lanes over pixels: int8_pixel_conv.py);
    a plain reduction, with a warning, where tensorize refuses them."""
    if is_pixel_conv(sch, block):
        schedule_pixel_conv(sch, block)
        return
    write_back = schedule_dot_conv(sch, block, VNNI_CONV)
    if write_back is not None:
        fuse_elementwise_epilogue(sch, sch.get_sblock(write_back))
