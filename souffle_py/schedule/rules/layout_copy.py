"""The layout-copy rule: a map copied into the channel quads vpdpbusd reads (LAYOUT_COPY,
te_passes/int8_conv_vnni.py: [N, C/4, H, W, 4] from NCHW, a transpose of four channel rows, with the
producer's requantization composed in). The injective rule vectorized it along its 4 channels, each
vector's lanes gathered H x W apart (0.34 ms for 256 x 56 x 56 int8 values); here the rows run in
parallel and a chunk of pixels (a vector's worth: vector_lanes() x 4 bytes) x the 4 channels is unrolled,
which LLVM's SLP vectorizer makes contiguous loads of each channel row and shuffles into one contiguous
store (0.07 ms). A copy [N, C/4, H, W, 4] whose loads run contiguously over h and w together (the map
unpadded, or padded by a stage of its own) takes its chunks over the fused pixels, whole vectors and the
rest a loop of its own: chunked along rows of 7 (ResNet-50's last stage), 58 or 30, the chunk was the
row's largest divisor up to a vector (7, 2, 15), and the copies ran at 1-20 GOP/s against 20-25.

A copy of a map whose writer runs in parallel tiles (a channel-lane conv's write-back of whole channel
vectors, NHWC: schedule/int8_conv.py) is computed in the writer's tile instead (`in_writer_tile`), from the
tile just stored (L1) by the core that stored it: as a pass of its own, half of each core's reads came from
the other core's cache (the copy ran over channel rows, the conv over pixels). ResNet-50 int8: 16 such
copies moved, copies and pads 0.86 -> 0.61 ms in a stage profile, the model 3.7% faster (A/B in one process).
The copy then iterates over the map it reads (transform_block_layout: TVM's reverse_compute_at maps a
tile's region back only through plain indices) and moves when every rule has run (`move_into_writer_tiles`:
moved at once, the next conv's tensorize refused the scope); where the move would compute any quad twice,
or TVM refuses it, the copy stays a pass of its own."""

from __future__ import annotations

import logging
import math

from tvm import tirx

from souffle_py.failures import not_applied
from souffle_py.ir.exprs import substitute
from souffle_py.ir.marks import LAYOUT_COPY
from souffle_py.schedule.bf16_gemm import divisor_at_most
from souffle_py.schedule.blocks import PARALLEL_MIN, block_loops, loop_extent, vector_lanes
from souffle_py.schedule.epilogue import loads_of
from souffle_py.schedule.flat import contiguous_suffix, when_scheduled
from souffle_py.schedule.rules.base import BlockRule
from souffle_py.schedule.rules.injective import schedule_injective

log = logging.getLogger(__name__)

IN_WRITER_TILE = "souffle.in_writer_tile"  # a copy to move into its writer's tile loop (move_into_writer_tiles)
UNROLLED_POINTS = 512  # the most points of a moved copy's two innermost loops unrolled together (else the last)


def schedule_layout_copy(sch, block) -> None:
    """Rows in parallel, a chunk of pixels x the channel quad unrolled (module docstring); a copy of another
    shape goes to the injective rule."""
    loops = block_loops(sch, block)
    if len(loops) < 3 or len(sch.get(block).iter_vars) != len(loops):
        schedule_injective(sch, block)
        return
    if in_writer_tile(sch, block):
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

    when_scheduled(stmt.name_hint, chunks, sch=sch)
    return True


def in_writer_tile(sch, block) -> bool:
    """Whether the copy will be computed in its writer's tile (module docstring): then it iterates over the
    map it reads and is marked for `move_into_writer_tiles`. False (nothing changed) where the writer is
    not one block under a parallel loop, the copy reads its map other than once through a bijective affine
    index, or the move, tried on a copy of the schedule, fails, computes a point twice or leaves a loop of
    varying extent (tiles that do not divide the map)."""
    writer, tile = _writer_tile(sch, block)
    if writer is None:
        return False
    stmt = sch.get(block)
    source = sch.get(writer).writes[0].source
    loads = loads_of(stmt.body, source)
    if len(loads) != 1 or len(loads[0].indices) != len(stmt.iter_vars):
        return False
    axes = [iv.var for iv in stmt.iter_vars]
    index_map = tirx.IndexMap.from_func(
        lambda *v: [substitute(i, {a.__chandle__(): x for a, x in zip(axes, v)}) for i in loads[0].indices],
        ndim=len(axes), index_dtype=str(stmt.iter_vars[0].dom.extent.ty))
    points = math.prod(int(iv.dom.extent) for iv in stmt.iter_vars)
    trial = sch.copy()
    try:
        moved = trial.get_sblock(stmt.name_hint)
        trial.transform_block_layout(moved, index_map)
        trial.reverse_compute_at(moved, _writer_tile(trial, moved)[1])
    except Exception as exc:  # noqa: BLE001  (tvm.s_tir.ScheduleError; the trial's, this schedule unchanged)
        log.debug("%s stays a pass of its own: %s", stmt.name_hint, str(exc).splitlines()[-1] if str(exc) else exc)
        return False
    extents = [trial.get(loop).extent for loop in trial.get_loops(moved)]
    if not all(isinstance(e, tirx.IntImm) for e in extents) or math.prod(int(e) for e in extents) != points:
        return False  # the tile's region mapped back ragged (a last tile cut short) or wider: quads twice
    sch.transform_block_layout(block, index_map)
    sch.annotate(block, IN_WRITER_TILE, 1)
    return True


def move_into_writer_tiles(sch, blocks) -> None:
    """Each copy of `blocks` (those `in_writer_tile` marked) computed in its writer's tile loop, its two
    innermost loops unrolled (up to UNROLLED_POINTS; LLVM's SLP vectorizer makes the tile's rows vectors);
    one that TVM refuses now keeps a plain injective schedule, with a warning."""
    for block in blocks:
        stmt = sch.get(block)
        try:
            sch.reverse_compute_at(block, _writer_tile(sch, block)[1])
        except Exception as exc:  # noqa: BLE001  (tvm.s_tir.ScheduleError: checked before anything changes)
            not_applied("layout copy in its writer's tile", stmt.name_hint, exc, "a pass of its own")
            schedule_injective(sch, block)
            continue
        inner = sch.get_loops(block)[1:]
        if not inner:
            continue
        last = inner[-2:] if math.prod(loop_extent(sch, loop) for loop in inner[-2:]) <= UNROLLED_POINTS else inner[-1:]
        for loop in last:
            sch.unroll(loop)


def _writer_tile(sch, block):
    """(the one block writing what `block` reads, the parallel loop its tiles run in), or (None, None)."""
    writers = sch.get_producers(block)
    if len(writers) != 1:
        return None, None
    loops = sch.get_loops(writers[0])
    if not loops or sch.get(loops[0]).kind != tirx.ForKind.PARALLEL or len(sch.get_child_blocks(loops[0])) < 2:
        return None, None
    return writers[0], loops[0]


class LayoutCopy(BlockRule):
    """A copy into an instruction's layout (its mark): a transpose unrolled for LLVM's SLP vectorizer."""

    name, mark = "layout copy", LAYOUT_COPY
    schedule = staticmethod(schedule_layout_copy)
