"""The layout-copy rule: a map copied into the channel quads vpdpbusd reads (LAYOUT_COPY,
te_passes/int8_conv_vnni.py: [N, C/4, H, W, 4] from NCHW, a transpose of four channel rows, with the
producer's requantization composed in). The injective rule vectorized it along its 4 channels, each
vector's lanes gathered H x W apart (0.34 ms for 256 x 56 x 56 int8 values); here the rows run in
parallel and a chunk of pixels (a vector's worth: vector_lanes() x 4 bytes) x the 4 channels is unrolled,
which LLVM's SLP vectorizer makes contiguous loads of each channel row and shuffles into one contiguous
store (0.07 ms). A copy [N, C/4, H, W, 4] whose loads run contiguously over h and w together (the map
unpadded, or padded by a stage of its own) takes its chunks over the fused pixels, whole vectors and the
rest a loop of its own: chunked along rows of 7 (ResNet-50's last stage), 58 or 30, the chunk was the
row's largest divisor up to a vector (7, 2, 15), and the copies ran at 1-20 GOP/s against 20-25."""

from __future__ import annotations

import math

from souffle_py.ir.marks import LAYOUT_COPY
from souffle_py.schedule.bf16_gemm import divisor_at_most
from souffle_py.schedule.blocks import PARALLEL_MIN, block_loops, loop_extent, vector_lanes
from souffle_py.schedule.flat import contiguous_suffix, when_scheduled
from souffle_py.schedule.rules.base import BlockRule
from souffle_py.schedule.rules.injective import schedule_injective


def schedule_layout_copy(sch, block) -> None:
    """Rows in parallel, a chunk of pixels x the channel quad unrolled (module docstring); a copy of another
    shape goes to the injective rule."""
    loops = block_loops(sch, block)
    if len(loops) < 3 or len(sch.get(block).iter_vars) != len(loops):
        schedule_injective(sch, block)
        return
    if _flat_pixels(sch, block, loops):
        return
    *outer, pixels, quad = loops
    total = math.prod(loop_extent(sch, loop) for loop in loops)
    _, chunk = sch.split(pixels, [None, divisor_at_most(loop_extent(sch, pixels), vector_lanes())])
    rows = sch.fuse(*outer) if len(outer) > 1 else outer[0]
    if total >= PARALLEL_MIN and loop_extent(sch, rows) > 1:
        sch.parallel(rows)
    sch.unroll(chunk)
    sch.unroll(quad)


def _flat_pixels(sch, block, loops) -> bool:
    """[N, C/4, H, W, 4] with each load contiguous over (h, w): rows in parallel, the pixels fused, chunks of
    a vector's pixels x the quad unrolled, the pixels no whole chunk holds a loop of their own (module
    docstring). False (nothing changed) for any other copy, or rows a vector's width already divides."""
    stmt = sch.get(block)
    if len(loops) != 5 or loop_extent(sch, loops[3]) % vector_lanes() == 0:
        return False
    if contiguous_suffix(stmt, list(stmt.iter_vars)[2:4], store_indices=False, conditions=False) != 2:
        return False
    b, cq, h, w, quad = loops
    total = math.prod(loop_extent(sch, loop) for loop in loops)
    rows = sch.fuse(b, cq)
    if total >= PARALLEL_MIN and loop_extent(sch, rows) > 1:
        sch.parallel(rows)
    pixels = sch.fuse(h, w)
    sch.unroll(quad)
    extent, lanes = loop_extent(sch, pixels), vector_lanes()
    whole = extent // lanes * lanes
    if whole == 0:
        return True

    def chunks(run=pixels):
        if whole < extent:
            run, _tail = sch.loop_partition(run, [whole, None])
        _, chunk = sch.split(run, [None, lanes])
        sch.unroll(chunk)

    when_scheduled(stmt.name_hint, chunks)
    return True


class LayoutCopy(BlockRule):
    """A copy into an instruction's layout (its mark): a transpose unrolled for LLVM's SLP vectorizer."""

    name, mark = "layout copy", LAYOUT_COPY
    schedule = staticmethod(schedule_layout_copy)
