"""The CPU's bfloat16 GEMM micro-kernel: `vdpbf16ps` (AVX512_BF16) through a TVM tensor intrinsic.

One `vdpbf16ps zmm_acc, zmm_a, zmm_b` adds, in each of 16 float32 lanes, the products of a pair of
bfloat16 values: acc[l] += a[2l] b[2l] + a[2l+1] b[2l+1]. The GEMM TEs that te_passes/precision.py
converts read their weight packed in K-pairs, Wp[j / 16, k / 2, j % 16, k % 2], so one 64-byte row of the
packed panel is the instruction's b operand, and the activation pair X[i, k:k+2] (32 bits) broadcast over
the lanes is its a operand. The tensor intrinsic DOT_16x2 covers one such instruction (16 columns, one
k-pair), the way TVM's own `dot_16x4_vnni` covers `vpdpbusd` (tvm/s_tir/tensor_intrin/x86.py).

Why an imported LLVM function and not `call_llvm_pure_intrin`: LLVM 22 declares the intrinsic
`llvm.x86.avx512bf16.dpbf16ps.512` over `<32 x bfloat>` vectors, which TVM 0.27's LLVM code generator
cannot produce (its bfloat16 lowering turns them into float32; a bfloat16 vector crashes it). So the
intrinsic calls `souffle_dpbf16ps` on integer vectors, defined in LLVM IR (DPBF16PS_LLVM: two bitcasts
and the instruction) and linked into the kernel with TVM's `pragma_import_llvm`; LLVM inlines it.

The schedule: rows fused (a batch of sequences is one row axis: the weight does not depend on it),
register tiles of `gemm_tile_rows()` rows x TILE_J columns (8 x 2 float32 accumulators of AVX-512's 32),
column chunks whose packed panels fit in L2, the k-pairs outermost in the tile, the 16 columns x 2 k of
the innermost step tensorized.
"""

from __future__ import annotations

import functools


from tvm import s_tir
from tvm.s_tir import TensorIntrin
from tvm.script import tirx as T

from souffle_py.failures import RuleDoesNotApply, not_applied, rule_failed
from souffle_py.schedule.blocks import block_loops, loop_extent
from souffle_py.schedule.budgets import gemm_tile_rows
from souffle_py.schedule.ragged import inline_output_copy, pad_to_tiles, tile_rows
from souffle_py.schedule.reductions import schedule_reduction
from te_passes.precision import PAIR
from souffle_py.schedule.thresholds import L2_CHUNK_BYTES  # packed panels per column chunk

DOT_16x2 = "souffle_dot_16x2_bf16"
LANES = 16                   # float32 lanes of the vdpbf16ps zmm intrinsic below (an ISA fact: AVX512_BF16)
TILE_J = 2 * LANES           # two accumulator vectors per row

DPBF16PS_LLVM = """
define linkonce_odr <16 x float> @souffle_dpbf16ps(<16 x float> %acc, <16 x i32> %a, <16 x i32> %b) alwaysinline {
  %x = bitcast <16 x i32> %a to <32 x bfloat>
  %y = bitcast <16 x i32> %b to <32 x bfloat>
  %r = call <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float> %acc, <32 x bfloat> %x, <32 x bfloat> %y)
  ret <16 x float> %r
}
declare <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float>, <32 x bfloat>, <32 x bfloat>)
"""


@functools.cache
def _register_dot_intrinsic() -> None:
    """Register DOT_16x2 with TVM, on first use: parsing TVMScript inspects the caller's stack, which cost
    0.9 s when it ran at import (every compile, every load from the compile cache, paid it)."""
    @T.prim_func(s_tir=True)
    def _dot_16x2_desc(a: T.Buffer((2,), "uint16", offset_factor=1), b: T.Buffer((16, 2), "uint16", offset_factor=1),
                       c: T.Buffer((16,), "float32", offset_factor=1, scope="local")) -> None:
        with T.sblock("root"):
            T.reads(c[0:16], a[0:2], b[0:16, 0:2])
            T.writes(c[0:16])
            for i in T.serial(0, 16):
                for k in T.serial(0, 2):
                    with T.sblock("update"):
                        vi, vk = T.axis.remap("SR", [i, k])
                        c[vi] = c[vi] + T.reinterpret("float32", T.shift_left(T.Cast("uint32", a[vk]), T.uint32(16))) \
                            * T.reinterpret("float32", T.shift_left(T.Cast("uint32", b[vi, vk]), T.uint32(16)))


    @T.prim_func(s_tir=True)
    def _dot_16x2_impl(a: T.Buffer((2,), "uint16", offset_factor=1), b: T.Buffer((16, 2), "uint16", offset_factor=1),
                       c: T.Buffer((16,), "float32", offset_factor=1, scope="local")) -> None:
        with T.sblock("root"):
            T.reads(c[0:16], a[0:2], b[0:16, 0:2])
            T.writes(c[0:16])
            pair = T.reinterpret(a.vload([0], "uint16x2"), dtype="int32")
            c[T.ramp(T.int32(0), 1, 16)] = T.call_pure_extern(
                "float32x16", "souffle_dpbf16ps", c.vload([0], dtype="float32x16"), T.broadcast(pair, 16),
                T.reinterpret(b.vload([0, 0], dtype="uint16x32"), dtype="int32x16"))


    TensorIntrin.register(DOT_16x2, _dot_16x2_desc, _dot_16x2_impl, override=True)


def schedule_bf16_gemm(sch: s_tir.Schedule, block) -> None:
    """Register tiles over the rows and the columns, the innermost 16 columns x one k-pair as one
    vdpbf16ps; float32 accumulators in registers, written back once per tile (the variants of
    `micro_kernel_variants`); a plain reduction schedule is the last resort."""
    if micro_kernel_variants(sch, block, _micro_kernel_tiles, "bf16 GEMM tiles") is None:
        rule_failed("the bf16 GEMM micro-kernel", sch.get(block).name_hint,
                    RuleDoesNotApply("no vdpbf16ps register tile fits"), "a plain reduction")
        schedule_reduction(sch, block)


# the micro-kernel GEMMs' variants, first fitting first: the rows of the outer axes fused into one row axis
# where tensorize accepts it (a batch of sequences), else only the innermost row axis tiled (Swin's windows:
# their fused rows bind in a way blockize refuses); rows that no tile divides padded up to balanced tiles
VARIANTS = ((True, True), (True, False), (False, True), (False, False))  # (fuse_rows, ragged)


def micro_kernel_variants(sch: s_tir.Schedule, block, tiles, label: str):
    """Schedule `block` with the first of VARIANTS that `tiles(sch, block, fuse_rows, ragged)` schedules on
    a scratch copy of the module (tensorize and blockize refuse some); `tiles` returns (the accumulators'
    write-back block, the padded result's copy or None). Returns that write-back block, or None where no
    variant fits."""
    name = sch.get(block).name_hint
    for fuse_rows, ragged in VARIANTS:
        if ragged and not _ragged_rows(sch, block, fuse_rows):
            continue  # the rows' divisor is as good: the plain variant next
        try:
            trial = s_tir.Schedule(sch.mod)
            inline_output_copy(trial, tiles(trial, trial.get_sblock(name), fuse_rows, ragged)[1], now=True)
        except Exception as exc:  # noqa: BLE001  (tvm.s_tir.ScheduleError from tensorize or blockize)
            not_applied(f"{label} (fuse_rows={fuse_rows}, ragged={ragged})", name, exc, "the next variant")
            continue
        write_back, copy = tiles(sch, block, fuse_rows, ragged)
        inline_output_copy(sch, copy)
        return write_back
    return None


def _ragged_rows(sch: s_tir.Schedule, block, fuse_rows: bool) -> bool:
    """Whether balanced row tiles with a masked last one beat the rows' largest divisor (ragged.tile_rows):
    13 or 509 tokens took one-row tiles, one dot-product instruction per weight vector loaded."""
    *outer, i, _, _ = block_loops(sch, block)
    extent = loop_extent(sch, i)
    for loop in outer if fuse_rows else ():
        extent *= loop_extent(sch, loop)
    return extent % tile_rows(extent, gemm_tile_rows())[0] != 0


def padded_rows(sch: s_tir.Schedule, block, ragged: bool):
    """`ragged`: the block's rows zero-padded up to whole balanced tiles (ragged.pad_to_tiles; tensorize
    refuses a masked last tile); the padded result's copy. Else None."""
    if not ragged:
        return None
    *_, i, _, _ = block_loops(sch, block)
    copy = pad_to_tiles(sch, block, tile_rows(loop_extent(sch, i), gemm_tile_rows())[0], 1)
    if copy is None:
        raise RuleDoesNotApply("TVM could not pad the rows (pad_einsum)")
    return copy


def _micro_kernel_tiles(sch: s_tir.Schedule, block, fuse_rows: bool, ragged: bool):
    copy = padded_rows(sch, block, ragged)
    *outer, i, j, k = block_loops(sch, block)
    if fuse_rows and outer:
        rows, outer = sch.fuse(*outer, i), []
    else:
        rows = i
    tile_i = divisor_at_most(loop_extent(sch, rows), gemm_tile_rows())
    tile_j = TILE_J if loop_extent(sch, j) % TILE_J == 0 else LANES
    io, ii = sch.split(rows, [None, tile_i])
    jo, jv, jl = sch.split(j, [None, tile_j // LANES, LANES])
    ko, kp = sch.split(k, [None, PAIR])
    tiles = loop_extent(sch, jo)
    per = max(1, L2_CHUNK_BYTES // (loop_extent(sch, ko) * PAIR * tile_j * 2))
    per = max(d for d in range(1, min(per, tiles) + 1) if tiles % d == 0)
    chunk, jo = sch.split(jo, [None, per])
    sch.reorder(chunk, *outer, io, jo, ko, ii, jv, jl, kp)
    acc = sch.cache_write(block, 0, "local")
    sch.reverse_compute_at(acc, jo)
    sch.vectorize(block_loops(sch, acc)[-1])
    finish_dot_tiles(sch, block, sch.fuse(chunk, *outer, io, jo), ko, jl, (ii, jv))
    return acc, copy


def finish_dot_tiles(sch: s_tir.Schedule, block, fused, reduction, lanes, unrolled) -> None:
    """The common end of a bf16 micro-kernel schedule (GEMM and conv): `lanes` (16 columns x one k-pair) on
    vdpbf16ps (finish_micro_kernel)."""
    finish_micro_kernel(sch, block, fused, reduction, lanes, unrolled, DOT_16x2, _register_dot_intrinsic,
                        DPBF16PS_LLVM)


def finish_micro_kernel(sch: s_tir.Schedule, block, fused, reduction, lanes, unrolled, intrinsic: str,
                        register, llvm_ir: str) -> None:
    """The common end of a dot-product micro-kernel schedule (bf16's vdpbf16ps, int8's vpdpbusd; GEMM and
    conv): tiles in parallel, accumulators initialized in vectors, `lanes` tensorized onto `intrinsic`
    (registered by `register()` on first use), the register tile unrolled, the instruction's LLVM IR
    imported."""
    sch.parallel(fused)
    init = sch.decompose_reduction(block, reduction)
    sch.vectorize(sch.get_loops(init)[-1])
    register()
    sch.tensorize(lanes, intrinsic)
    for loop in unrolled:
        sch.unroll(loop)
    sch.annotate(fused, "pragma_import_llvm", llvm_ir)


def divisor_at_most(extent: int, limit: int) -> int:
    return max(d for d in range(1, min(extent, limit) + 1) if extent % d == 0)
