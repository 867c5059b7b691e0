"""The CPU's int8 GEMM micro-kernel: `vpdpbusd` (AVX512_VNNI) through a TVM tensor intrinsic.

One `vpdpbusd zmm_acc, zmm_a, zmm_b` adds, in each of 16 int32 lanes, four products of a uint8 and an
int8 value: acc[l] += a[4l] b[4l] + ... + a[4l+3] b[4l+3]. te_passes/int8_gemm.py forms the GEMMs it
fits: uint8 activations, the int8 weight packed Wp[j / 16, k / 4, j % 16, k % 4], so one 64-byte row is
the instruction's b operand and four consecutive activations X[i, k:k+4] (32 bits) broadcast over the
lanes its a operand. DOT_16x4 is TVM's own `dot_16x4_vnni` (tvm/s_tir/tensor_intrin/x86.py) with its
accumulators in registers ("local"), which the tiles below keep them in.

The schedule is the bf16 GEMM's (schedule/bf16_gemm.py): rows fused, register tiles of `gemm_tile_rows()`
rows x 2 vectors of columns, the k-quads outermost in the tile, the 16 columns x 4 k of the innermost step
tensorized, the accumulators written back once per tile, through the GEMM's elementwise reader where it
has one (epilogue.py: the compensation, scales and bias of a dynamically quantized GEMM, which took a pass
over the int32 map of their own, and the activation that reads them).
"""

from __future__ import annotations

import functools
import logging

from tvm import s_tir
from tvm.s_tir import TensorIntrin
from tvm.script import tirx as T

from souffle_py.cpu_target import current
from souffle_py.schedule.bf16_gemm import divisor_at_most, finish_micro_kernel, micro_kernel_variants, padded_rows
from souffle_py.schedule.blocks import block_loops, loop_extent
from souffle_py.schedule.budgets import gemm_tile_rows
from souffle_py.schedule.epilogue import fuse_epilogue_chain
from te_passes.int8_gemm import INT8_GEMM, VNNI_DEPTH

log = logging.getLogger(__name__)

DOT_16x4 = "souffle_dot_16x4_vnni"
# LLVM 22 declares the intrinsic over <64 x i8> operands, which TVM's call_llvm_pure_intrin does not pass
# (TVM's own dot_16x4_vnni fails LLVM's verifier here): a three-line LLVM IR function, imported into the
# kernel with pragma_import_llvm and inlined, takes int32 vectors, as the bf16 kernel's does
VPDPBUSD_LLVM = """
define linkonce_odr <16 x i32> @souffle_vpdpbusd(<16 x i32> %acc, <16 x i32> %a, <16 x i32> %b) alwaysinline {
  %x = bitcast <16 x i32> %a to <64 x i8>
  %y = bitcast <16 x i32> %b to <64 x i8>
  %r = call <16 x i32> @llvm.x86.avx512.vpdpbusd.512(<16 x i32> %acc, <64 x i8> %x, <64 x i8> %y)
  ret <16 x i32> %r
}
declare <16 x i32> @llvm.x86.avx512.vpdpbusd.512(<16 x i32>, <64 x i8>, <64 x i8>)
"""
LANES = 16          # int32 lanes of the vpdpbusd zmm intrinsic below (an ISA fact: AVX512_VNNI)
TILE_J = 2 * LANES  # two accumulator vectors per row
EPILOGUE_LINKS = 2  # elementwise readers computed in the write-back: the int32 sum's scaling + bias, then GELU


def vnni_lanes() -> int:
    """LANES where the target compiled for has AVX512_VNNI, else 0 (the plain int32 GEMM). AVX-VNNI
    (256-bit, without AVX-512) is not served yet."""
    return LANES if current().has("avx512vnni") else 0


@functools.cache
def _register_dot_intrinsic() -> None:
    """Register DOT_16x4 with TVM on first use (parsing TVMScript at import costs every compile)."""
    @T.prim_func(s_tir=True)
    def _desc(a: T.Buffer((4,), "uint8", offset_factor=1), b: T.Buffer((16, 4), "int8", offset_factor=1),
              c: T.Buffer((16,), "int32", offset_factor=1, scope="local")) -> None:
        with T.sblock("root"):
            T.reads(c[0:16], a[0:4], b[0:16, 0:4])
            T.writes(c[0:16])
            for i in T.serial(0, 16):
                for k in T.serial(0, 4):
                    with T.sblock("update"):
                        vi, vk = T.axis.remap("SR", [i, k])
                        c[vi] = c[vi] + T.cast(a[vk], "int32") * T.cast(b[vi, vk], "int32")

    @T.prim_func(s_tir=True)
    def _impl(a: T.Buffer((4,), "uint8", offset_factor=1), b: T.Buffer((16, 4), "int8", offset_factor=1),
              c: T.Buffer((16,), "int32", offset_factor=1, scope="local")) -> None:
        with T.sblock("root"):
            T.reads(c[0:16], a[0:4], b[0:16, 0:4])
            T.writes(c[0:16])
            quad = T.reinterpret(a.vload([0], "uint8x4"), dtype="int32")
            c[T.ramp(T.int32(0), 1, 16)] = T.call_pure_extern(
                "int32x16", "souffle_vpdpbusd", c.vload([0], dtype="int32x16"), T.broadcast(quad, 16),
                T.reinterpret(b.vload([0, 0], dtype="int8x64"), dtype="int32x16"))

    TensorIntrin.register(DOT_16x4, _desc, _impl, override=True)


def is_vnni_gemm(sch: s_tir.Schedule, block) -> bool:
    """Whether the block is an integer GEMM in vpdpbusd's form (te_passes/int8_gemm.py's annotation)."""
    value = sch.get(block).annotations.get(INT8_GEMM)
    return value is not None and int(value) == LANES


def schedule_vnni_gemm(sch: s_tir.Schedule, block, fallback=None) -> None:
    """Register tiles over rows and columns, the innermost 16 columns x 4 k as one vpdpbusd (the variants of
    bf16_gemm.micro_kernel_variants), `fallback` (a plain reduction schedule) the last resort."""
    acc = micro_kernel_variants(sch, block, _tiles, "VNNI GEMM tiles")
    if acc is not None:
        fuse_epilogue_chain(sch, acc, EPILOGUE_LINKS)
        return
    log.warning("%s: no vpdpbusd schedule fits this int8 GEMM; it runs as a plain reduction",
                sch.get(block).name_hint)
    if fallback is not None:
        fallback(sch, block)


def finish_vnni_tiles(sch: s_tir.Schedule, block, fused, reduction, lanes, unrolled) -> None:
    """The common end of a VNNI micro-kernel schedule (the convolution's, int8_conv.py): `lanes` (16 columns
    x one k-quad) on vpdpbusd (bf16_gemm.finish_micro_kernel)."""
    finish_micro_kernel(sch, block, fused, reduction, lanes, unrolled, DOT_16x4, _register_dot_intrinsic,
                        VPDPBUSD_LLVM)


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
    tile_i = divisor_at_most(extent, gemm_tile_rows())
    tile_j = TILE_J if loop_extent(sch, j) % TILE_J == 0 else LANES
    io, ii = sch.split(rows, [None, tile_i])
    jo, jv, jl = sch.split(j, [None, tile_j // LANES, LANES])
    ko, kq = sch.split(k, [None, VNNI_DEPTH])
    sch.reorder(*outer, io, jo, ko, ii, jv, jl, kq)
    acc = sch.cache_write(block, 0, "local")
    sch.reverse_compute_at(acc, jo)
    sch.vectorize(block_loops(sch, acc)[-1])
    finish_vnni_tiles(sch, block, sch.fuse(*outer, io, jo), ko, jl, (ii, jv))
    return acc, copy
