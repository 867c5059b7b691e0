"""The CPU's int8 GEMM micro-kernel: the target's four-deep dot product (int8_dot.py: `vpdpbusd` with
AVX512_VNNI or AVX-VNNI, a pair of `vpmaddwd` on AVX2) through a TVM tensor intrinsic.

One instruction adds, in each of its L int32 lanes (16 on AVX-512, 8 on AVX2), four products of a uint8 and
an int8 value: acc[l] += a[4l] b[4l] + ... + a[4l+3] b[4l+3]. te_passes/int8_gemm.py forms the GEMMs it
fits: uint8 activations, the int8 weight packed Wp[j / L, k / 4, j % L, k % 4], so one row of the packed
weight is the instruction's b operand and four consecutive activations X[i, k:k+4] (32 bits) broadcast
over the lanes its a operand. The intrinsic is TVM's own `dot_16x4_vnni` (tvm/s_tir/tensor_intrin/x86.py)
with its accumulators in registers ("local"), which the tiles below keep them in.

The schedule is the bf16 GEMM's (schedule/bf16_gemm.py): rows fused, register tiles of `gemm_tile_rows()`
rows x 2 vectors of columns, the k-quads outermost in the tile, the L columns x 4 k of the innermost step
tensorized, the accumulators written back once per tile, through the GEMM's elementwise reader where it
has one (epilogue.py: the compensation, scales and bias of a dynamically quantized GEMM, which took a pass
over the int32 map of their own, and the activation that reads them)."""

from __future__ import annotations

from tvm import s_tir

from souffle_py.failures import RuleDoesNotApply, rule_failed
from souffle_py.schedule.bf16_gemm import (L2_CHUNK_BYTES, divisor_at_most, finish_micro_kernel, micro_kernel_variants,
                                           padded_rows)
from souffle_py.schedule.blocks import block_loops, loop_extent
from souffle_py.schedule.budgets import gemm_tile_rows
from souffle_py.schedule.epilogue import fuse_epilogue_chain
from souffle_py.schedule.int8_dot import dot4, dot4_lanes, stage_arithmetic
from te_passes.int8_gemm import INT8_GEMM, VNNI_DEPTH, WIDE_INPUT

CHUNK_COLUMNS = True  # column tiles in chunks whose weights stay in L2 (_columns_per_chunk)
EPILOGUE_LINKS = 2  # elementwise readers computed in the write-back: the int32 sum's scaling + bias (or its
# requantization), then GELU (and its quantization)


def is_vnni_gemm(sch: s_tir.Schedule, block) -> bool:
    """Whether the block is an integer GEMM in vpdpbusd's form (te_passes/int8_gemm.py's annotation)."""
    value = sch.get(block).annotations.get(INT8_GEMM)
    return value is not None and int(value) > 1 and int(value) == dot4_lanes()


def schedule_vnni_gemm(sch: s_tir.Schedule, block, fallback=None) -> None:
    """Register tiles over rows and columns, the innermost 16 columns x 4 k as one vpdpbusd (the variants of
    bf16_gemm.micro_kernel_variants), `fallback` (a plain reduction schedule) the last resort."""
    with stage_arithmetic(sch, block):  # the form te_passes gave the stage (dot_weights.pair_form)
        acc = micro_kernel_variants(sch, block, _tiles, "VNNI GEMM tiles")
        instruction = dot4().instruction
    if acc is not None:
        fuse_epilogue_chain(sch, acc, EPILOGUE_LINKS)
        return
    rule_failed("the int8 GEMM micro-kernel", sch.get(block).name_hint,
                RuleDoesNotApply(f"no {instruction} register tile fits"), "a plain reduction")
    if fallback is not None:
        fallback(sch, block)


def finish_vnni_tiles(sch: s_tir.Schedule, block, fused, reduction, lanes, unrolled, wide: bool = False) -> None:
    """The common end of a VNNI micro-kernel schedule (the convolution's, int8_conv.py): `lanes` (a vector
    of columns x one k-quad) on the target's dot product (int8_dot.py; bf16_gemm.finish_micro_kernel);
    `wide`: its form over activations widened to int16 in memory."""
    dot = dot4()
    finish_micro_kernel(sch, block, fused, reduction, lanes, unrolled,
                        dot.wide_intrinsic if wide else dot.gemm_intrinsic, dot.register, dot.llvm_ir)


def _tiles(sch: s_tir.Schedule, block, fuse_rows: bool, ragged: bool = False):
    """The VNNI register tiles of `block` (`ragged`: its rows zero-padded up to whole balanced tiles,
    ragged.pad_to_tiles, since tensorize refuses a masked tile); returns the accumulators' write-back block
    and the padded result's copy (or None)."""
    copy = padded_rows(sch, block, ragged)
    *outer, i, j, k = block_loops(sch, block)
    if fuse_rows and outer:
        rows, outer = sch.fuse(*outer, i), []
    else:
        rows = i
    extent = loop_extent(sch, rows)
    lanes = dot4().lanes
    tile_i = divisor_at_most(extent, gemm_tile_rows())
    tile_j = 2 * lanes if loop_extent(sch, j) % (2 * lanes) == 0 else lanes  # two accumulator vectors per row
    io, ii = sch.split(rows, [None, tile_i])
    jo, jv, jl = sch.split(j, [None, tile_j // lanes, lanes])
    ko, kq = sch.split(k, [None, VNNI_DEPTH])
    chunk, jo = sch.split(jo, [None, _columns_per_chunk(loop_extent(sch, jo), loop_extent(sch, ko) * tile_j)])
    sch.reorder(chunk, *outer, io, jo, ko, ii, jv, jl, kq)
    acc = sch.cache_write(block, 0, "local")
    sch.reverse_compute_at(acc, jo)
    sch.vectorize(block_loops(sch, acc)[-1])
    wide = bool(int(sch.get(block).annotations.get(WIDE_INPUT, 0)))
    finish_vnni_tiles(sch, block, sch.fuse(chunk, *outer, io, jo), ko, jl, (ii, jv), wide)
    return acc, copy


def _columns_per_chunk(tiles: int, quads_per_tile: int) -> int:
    """Column tiles per chunk, whose packed weights (`quads_per_tile` x 4 values each) stay in L2 while every
    row tile reads them (as the bf16 GEMM's chunks; rows outermost streamed every weight once per row tile:
    BERT-base's 768 x 768 weights as AVX2's int16 pairs, 1.2 MB per 4 rows). CHUNK_COLUMNS off: one chunk."""
    if not CHUNK_COLUMNS:
        return tiles
    per = max(1, L2_CHUNK_BYTES // (quads_per_tile * VNNI_DEPTH * dot4().weight_bytes))
    return max(d for d in range(1, min(per, tiles) + 1) if tiles % d == 0)
