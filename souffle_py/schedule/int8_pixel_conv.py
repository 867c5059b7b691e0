"""The CPU's int8 1 x 1 convolution with its lanes over output pixels (te_passes/int8_conv_vnni.py's
`pixel_lanes` form): one `vpdpbusd` (or the target's equivalent, int8_dot.py) adds, for 16 consecutive
output pixels of one output channel (8 on AVX2), the products of their four input channels (one 64-byte
row of the input quads, 32 bytes on AVX2: the a operand) and that channel's four weights (32 bits
broadcast, the b operand, which the instruction can read from memory).

The register tile is `tile_shape()` output channels x vectors of pixels (the accumulators, beside the
pixel vectors loaded once per channel quad), the channel quads outside it; pixel
tiles in parallel, channel tiles innermost so that a tile's input stays in L1 for every channel. The
accumulators are written back as whole vectors along the NCHW rows, through the convolution's elementwise
epilogue (its requantization), which is laid over the same flat pixels first.
"""

from __future__ import annotations

import math

import tvm
from tvm import s_tir, tirx

from souffle_py.failures import not_applied, rule_failed
from souffle_py.schedule.bf16_conv import scratch_schedule
from souffle_py.schedule.bf16_gemm import L2_CHUNK_BYTES, finish_micro_kernel
from souffle_py.schedule.blocks import block_kind, block_loops, loop_extent, vector_registers
from souffle_py.schedule.budgets import pixel_panel_fits
from souffle_py.schedule.epilogue import fuse_elementwise_epilogue, is_intermediate
from souffle_py.schedule.int8_dot import dot4, stage_arithmetic
from souffle_py.schedule.reductions import schedule_reduction
from souffle_py.schedule.thresholds import PIXEL_TILE_ACCUMULATORS
from te_passes.int8_conv_vnni import PIXEL_LANES
from te_passes.int8_gemm import VNNI_DEPTH

def is_pixel_conv(sch: s_tir.Schedule, block) -> bool:
    """Whether the block is a VNNI conv in the pixel-lane form (int8_conv_vnni.py's mark)."""
    return sch.get(block).annotations.get(PIXEL_LANES) is not None


def tile_shape(pixel_vectors: int, channels: int, depth_quads: int = 0) -> tuple[int, int]:
    """(output channels, vectors of pixels) per register tile, channels dividing `channels` (at most one
    block of the packed weight's lanes, whose quads the tile broadcasts) and vectors `pixel_vectors`: the
    channels x vectors accumulators and one loaded vector of input per pixel vector within the target's
    vector registers; the tile's input panel (`depth_quads` x vectors x 4 x lanes bytes, which every channel tile
    reads again) within PIXEL_PANEL_L1_SHARE of the target's L1d (budgets.pixel_panel_fits) where any
    tile's is; enough accumulators to cover the instruction's latency (PIXEL_TILE_ACCUMULATORS), then the
    fewest loads per instruction (1 / vectors: a weight quad broadcast per channel, + 1 / channels: an
    input vector per pixel vector).
    Measured on ResNet-50's convs, the pixel convs' stage time: 56 x 56 maps, 16 x 1 2.0 ms, 8 x 2 1.8,
    4 x 4 and 2 x 7 1.75; 28 x 28 maps (49 vectors: 16 x 1 or 2 x 7) 1.5 against 1.1; 14 x 14 maps (13
    vectors padded) 16 x 1 2.1 against 2.7 for 1 x 13. At 512 input channels a 2 x 7 tile's panel is 56
    KiB, beyond the 48 KiB L1d: 28 x 28 maps padded to 50 vectors, 8 x 2 tiles ran those convs 0.92 ms,
    4 x 5 (40 KiB) 0.95, 2 x 7 1.35."""
    dot = dot4()
    per = dot.operand_registers
    registers = vector_registers() - per
    best, score = (1, 1), (False, 0, 0.0)
    for vectors in (d for d in range(1, pixel_vectors + 1) if pixel_vectors % d == 0):
        for ch in (d for d in range(1, min(channels, dot.lanes) + 1) if channels % d == 0):
            if (ch + per) * vectors > registers:
                continue
            this = (pixel_panel_fits(vectors, depth_quads, dot.lanes), min(ch * vectors, PIXEL_TILE_ACCUMULATORS),
                    -(1 / vectors + 1 / ch))
            if this > score:
                best, score = (ch, vectors), this
    return best


def schedule_pixel_conv(sch: s_tir.Schedule, block) -> None:
    """The pixel-lane tiles (module docstring) and the epilogue in their write-back; a plain reduction,
    with a warning (strict mode: an error), where tensorize refuses them."""
    name = sch.get(block).name_hint
    trial = scratch_schedule(sch)
    try:
        made = _tiles(trial if trial is not None else sch, trial.get_sblock(name) if trial is not None else block)
    except Exception as exc:  # noqa: BLE001  (tvm.s_tir.ScheduleError from tensorize or blockize)
        rule_failed("int8 pixel conv tiles", name, exc, "a plain reduction")
        if trial is not None:
            schedule_reduction(sch, block)
        return
    write_back = _tiles(sch, block) if trial is not None else made
    _flat_epilogue(sch, sch.get_sblock(write_back))


def _tiles(sch: s_tir.Schedule, block) -> str:
    with stage_arithmetic(sch, block):  # the form te_passes gave the stage (dot_weights.pair_form)
        return _dot_tiles(sch, block, dot4())


def _dot_tiles(sch: s_tir.Schedule, block, dot) -> str:
    n, f, p, cq, q = block_loops(sch, block)
    channels, vectors = tile_shape(loop_extent(sch, p) // dot.lanes, loop_extent(sch, f), loop_extent(sch, cq))
    fo, fi = sch.split(f, [None, channels])
    po, pv, pl = sch.split(p, [None, vectors, dot.lanes])
    weight_bytes = loop_extent(sch, cq) * VNNI_DEPTH * channels * dot.weight_bytes
    count = loop_extent(sch, fo)
    per = max(d for d in range(1, count + 1) if count % d == 0 and d * weight_bytes <= max(L2_CHUNK_BYTES, weight_bytes))
    chunk, fo = sch.split(fo, [None, per])
    sch.reorder(chunk, n, po, fo, cq, fi, pv, pl, q)
    acc = sch.cache_write(block, 0, "local")
    sch.reverse_compute_at(acc, fo)
    sch.vectorize(block_loops(sch, acc)[-1])
    finish_micro_kernel(sch, block, sch.fuse(chunk, n, po, fo), cq, pl, (fi, pv), dot.pixel_intrinsic, dot.register,
                        dot.llvm_ir)
    return sch.get(acc).name_hint


def _flat_epilogue(sch: s_tir.Schedule, write_back) -> None:
    """The sum's reader laid over the flat pixels (its loads of the sum then plain indices, which TVM's
    reverse_compute_inline needs) and computed in the write-back; the sum's reshape to NCHW, where the
    vertical pass left it a TE of its own, inlined into its reader first."""
    readers = sch.get_consumers(write_back)
    if len(readers) == 1 and _is_plain_copy(sch.get(readers[0])):
        reshape = readers[0]
        readers = sch.get_consumers(reshape)
        try:
            sch.compute_inline(reshape)
        except Exception as exc:  # noqa: BLE001  (tvm.s_tir.ScheduleError: checked before anything changes)
            not_applied("pixel conv reshape inlining", sch.get(reshape).name_hint, exc, "a pass of its own")
            return
    if len(readers) != 1 or block_kind(sch, readers[0]) != "injective":
        return
    reader = readers[0]
    stmt = sch.get(reader)
    if math.prod(int(iv.dom.extent) for iv in stmt.iter_vars) != math.prod(
            int(d) for d in sch.get(write_back).writes[0].source.shape):
        # a map padded up to whole vectors (int8_conv_vnni.PIXEL_PADDING): its reader stays a pass of its own.
        # Computed in the write-back, under the predicate of the padding, a schedule made anew from the
        # function (bf16_conv.scratch_schedule) no longer saw the write-back's reads covered by the tiles
        # (TVM's region bound under the predicate: to the map's end), and every conv after it lost its tiles
        return
    if len(stmt.iter_vars) == 4:  # else laid flat already, by the other sum it reads (a residual add)
        width = int(stmt.iter_vars[3].dom.extent)
        try:
            sch.transform_block_layout(reader, lambda n, f, h, w: (n, f, h * width + w))
            if is_intermediate(sch, stmt.writes[0].source):  # its readers then read it flat too
                sch.transform_layout(reader, ("write", 0), lambda n, f, h, w: (n, f, h * width + w))
        except Exception as exc:  # noqa: BLE001  (tvm.s_tir.ScheduleError: checked before anything changes)
            not_applied("pixel conv epilogue layout", stmt.name_hint, exc, "a pass of its own")
            return
    fuse_elementwise_epilogue(sch, write_back, requantize=True)


def _is_plain_copy(stmt) -> bool:
    """Whether the block stores one load of another buffer, unchanged (a reshape)."""
    return isinstance(stmt.body, tirx.BufferStore) and isinstance(stmt.body.value, tvm.ir.TensorLoad)
