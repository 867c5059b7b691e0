"""The layout-copy rule: a map copied into the channel quads vpdpbusd reads (LAYOUT_COPY,
te_passes/int8_conv_vnni.py: [N, C/4, H, W, 4] from NCHW, a transpose of four channel rows, with the
producer's requantization composed in). The injective rule vectorized it along its 4 channels, each
vector's lanes gathered H x W apart (0.34 ms for 256 x 56 x 56 int8 values); here the rows run in
parallel and a chunk of pixels (a vector's worth: vector_lanes() x 4 bytes) x the 4 channels is unrolled,
which LLVM's SLP vectorizer makes contiguous loads of each channel row and shuffles into one contiguous
store (0.07 ms)."""

from __future__ import annotations

import math

from souffle_py.ir.marks import LAYOUT_COPY
from souffle_py.schedule.bf16_gemm import divisor_at_most
from souffle_py.schedule.blocks import PARALLEL_MIN, block_loops, loop_extent, vector_lanes
from souffle_py.schedule.rules.base import BlockRule
from souffle_py.schedule.rules.injective import schedule_injective


def schedule_layout_copy(sch, block) -> None:
    """Rows in parallel, a chunk of pixels x the channel quad unrolled (module docstring); a copy of another
    shape goes to the injective rule."""
    loops = block_loops(sch, block)
    if len(loops) < 3 or len(sch.get(block).iter_vars) != len(loops):
        schedule_injective(sch, block)
        return
    *outer, pixels, quad = loops
    total = math.prod(loop_extent(sch, loop) for loop in loops)
    _, chunk = sch.split(pixels, [None, divisor_at_most(loop_extent(sch, pixels), vector_lanes())])
    rows = sch.fuse(*outer) if len(outer) > 1 else outer[0]
    if total >= PARALLEL_MIN and loop_extent(sch, rows) > 1:
        sch.parallel(rows)
    sch.unroll(chunk)
    sch.unroll(quad)


class LayoutCopy(BlockRule):
    """A copy into an instruction's layout (its mark): a transpose unrolled for LLVM's SLP vectorizer."""

    name, mark = "layout copy", LAYOUT_COPY
    schedule = staticmethod(schedule_layout_copy)
