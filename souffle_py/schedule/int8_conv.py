"""The CPU's int8 convolution micro-kernel: the int8 GEMM's dot-product tensor intrinsic (int8_gemm.py,
int8_dot.py) on the bf16 convolution's tiles (bf16_conv.py: a row of output pixels x one or two vectors of
output channels, input channels and taps outside it), over the convolutions te_passes/int8_conv_vnni.py put
in vpdpbusd's form: four input channels per lane instead of two. The accumulators are written back once per
tile through the convolution's elementwise epilogue (its compensation and scales, or its requantization).

A convolution with its channels in the lanes writes NCHW by transposing its tile element by element; where
its map is only requantized for the next convolutions' input quads (LAYOUT_COPY copies, which read four
channels of a pixel at once), the map and its requantization are laid out NHWC instead
(`_channels_last_requantization`): the write-back stores whole vectors of channels, the requantization
computed in it, and the copies read each pixel's quad as four contiguous bytes. ResNet-50's 3 x 3 convs
(a stage model of 5, A/B in one process): convs, requantizing passes and copies 1.07 -> 0.98 ms. So is a
map that a channels-last int8 pool reads (te_passes/int8_pool.py: ResNet's stem).
"""

from __future__ import annotations

import functools
import logging

from tvm import s_tir, tirx

from souffle_py.failures import not_applied
from souffle_py.ir.marks import LAYOUT_COPY
from souffle_py.schedule.bf16_conv import DotConv, schedule_dot_conv
from souffle_py.schedule.blocks import block_kind, block_loops
from souffle_py.schedule.epilogue import fuse_elementwise_epilogue, is_intermediate, loads_of
from souffle_py.schedule.int8_dot import dot4, dot4_lanes, stage_arithmetic
from souffle_py.schedule.int8_gemm import finish_vnni_tiles
from souffle_py.schedule.int8_pixel_conv import is_pixel_conv, schedule_pixel_conv
from te_passes.int8_conv_vnni import INT8_CONV
from te_passes.int8_gemm import VNNI_DEPTH, WIDE_INPUT

log = logging.getLogger(__name__)

CHANNELS_LAST = True  # (off: every channel-lane conv writes NCHW, requantized by a pass of its own)


def is_vnni_conv(sch: s_tir.Schedule, block) -> bool:
    """Whether the block is an integer convolution in vpdpbusd's form (int8_conv_vnni.py's mark)."""
    value = sch.get(block).annotations.get(INT8_CONV)
    return value is not None and int(value) > 1 and int(value) == dot4_lanes()


def schedule_vnni_conv(sch: s_tir.Schedule, block) -> None:
    """The VNNI tiles (module docstring; a 1 x 1 convolution with its lanes over pixels: int8_pixel_conv.py);
    a plain reduction, with a warning (strict mode: an error), where tensorize refuses them."""
    if is_pixel_conv(sch, block):
        schedule_pixel_conv(sch, block)
        return
    with stage_arithmetic(sch, block):  # the form te_passes gave the stage (dot_weights.pair_form)
        dot = dot4()
        wide = bool(int(sch.get(block).annotations.get(WIDE_INPUT, 0)))
        finish = functools.partial(finish_vnni_tiles, wide=wide)
        write_back = schedule_dot_conv(sch, block, DotConv("int8", dot.instruction, VNNI_DEPTH, dot.weight_bytes,
                                                           finish, dot.lanes, dot.operand_registers))
    if write_back is None:
        return
    write_back = sch.get_sblock(write_back)
    if not _channels_last_requantization(sch, write_back):
        fuse_elementwise_epilogue(sch, write_back)


def _reads_channels_innermost(block, buffer) -> bool:
    """Whether every read of the NCHW `buffer` in `block` takes its channel from the block's innermost
    spatial iteration (te_passes/int8_pool.py's channels-last pool): an NHWC map serves it contiguously."""
    spatial = [iv.var for iv in block.iter_vars if int(iv.iter_type) == 0]
    loads = loads_of(block.body, buffer)
    return bool(loads) and bool(spatial) and all(
        len(load.indices) == 4 and isinstance(load.indices[1], tirx.Var) and load.indices[1].same_as(spatial[-1])
        for load in loads)


def _channels_last_requantization(sch: s_tir.Schedule, write_back) -> bool:
    """The NCHW int32 map of `write_back` and its one requantizing reader's map laid out NHWC, the
    requantization computed in the write-back of whole channel vectors, where only input-quad copies and
    channels-last pools read the requantized map (module docstring). False where the maps are another kind
    (nothing changed), or a layout change is refused (logged; one made before it leaves a valid schedule,
    the reader apart)."""
    readers = sch.get_consumers(write_back)
    if not CHANNELS_LAST or len(readers) != 1 or block_kind(sch, readers[0]) != "injective":
        return False
    reader, written = sch.get(readers[0]), sch.get(write_back).writes[0].source
    requantized = reader.writes[0].source
    map_readers = sch.get_consumers(readers[0])
    if (len(written.shape) != 4 or len(reader.iter_vars) != 4 or len(block_loops(sch, readers[0])) != 4
            or len(requantized.shape) != 4 or not is_intermediate(sch, written) or not is_intermediate(sch, requantized)
            or not map_readers or not all(LAYOUT_COPY in sch.get(r).annotations
                                          or _reads_channels_innermost(sch.get(r), requantized) for r in map_readers)):
        return False
    nhwc = lambda n, f, h, w: (n, h, w, f)  # noqa: E731
    try:
        sch.transform_block_layout(readers[0], nhwc)
        sch.transform_layout(readers[0], ("write", 0), nhwc)
        sch.transform_layout(write_back, ("write", 0), nhwc)
    except Exception as exc:  # noqa: BLE001  (tvm.s_tir.ScheduleError: each checked before it changes anything)
        not_applied("channels-last int8 conv write-back", reader.name_hint, exc, "NCHW, requantized apart")
        return False
    *_, channels, pixels = block_loops(sch, write_back)
    sch.reorder(pixels, channels)
    sch.vectorize(channels)
    if fuse_elementwise_epilogue(sch, write_back, requantize=True) is None:
        log.debug("%s: requantization left apart from %s (NHWC)", reader.name_hint, sch.get(write_back).name_hint)
    return True
