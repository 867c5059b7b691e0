"""Tensor-core GEMMs for reduced precision (te_passes/precision.py, `Native`): a GEMM whose operands are
float16 or bfloat16 multiplies 16 x 16 x 16 fragments with `wmma::mma_sync`, accumulating in float32.

`TensorCoreMatmul` is a dlight rule for a whole kernel (a tiled kernel: the GEMM and its element-wise
epilogue), built like dlight's own `MatmulTensorization` (which knows float16 only): the GEMM normalized to
C[b, i, j] += A[b, i, k] * B[b, j, k] (dlight's reindex), padded to whole tiles, each block a tile of
16-row fragments per warp, both operands staged through shared memory by all threads with vectorized
loads, fragments loaded from there (`wmma::load_matrix_sync`), the accumulators stored back through shared
memory into the epilogue. TVM 0.27 registers wmma intrinsics for float16 only; those for bfloat16 are
registered here from TVM's own generators (tvm/s_tir/tensor_intrin/cuda.py), and CUDA's `mma.h` provides
the bfloat16 fragments from sm_80.

`GridTensorCores` is the same schedule for one GEMM stage of a grid-synchronized kernel, scheduled alone
and transplanted into the kernel (transplant.py, wmma_stages.py): the kernel's 8 warps, 64 x 64 tiles,
static shared memory, whole tiles only; `TensorCoreRefusal` says why a GEMM has no wmma schedule.
"""

from __future__ import annotations

import re

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.dlight.gpu.base import GPUScheduleRule
from tvm.s_tir.dlight.gpu.matmul import (auto_inline_consumer_chain, auto_inline_producers, get_index_map,
                                         get_reduction_blocks)

from souffle_py.errors import SouffleError

STORAGE = {"fp16": "float16", "bf16": "bfloat16"}
MIN_ARCH = {"fp16": 70, "bf16": 80}   # tensor cores take float16 from Volta, bfloat16 from Ampere
FRAGMENT = 16                         # m = n = k of a wmma fragment
WARP = 32
VECTOR = 4                            # elements per thread of a shared-memory load (8 bytes of float16)
SCOPE = "shared.dyn"


def sm_version(arch: str) -> int:
    """70 for "sm_70", 90 for "sm_90a"; -1 when unknown."""
    digits = re.sub(r"\D", "", str(arch))
    return int(digits) if digits else -1


def on_tensor_cores(op) -> str:
    """The operand dtype of a TE that te_passes/precision.py made a GEMM of reduced-precision operands
    (a tensor-core GEMM), else ""."""
    from souffle_py.ir.marks import REDUCED_GEMM

    return str((op.attrs or {}).get(REDUCED_GEMM, "")) if hasattr(op, "attrs") else ""


def reduced_dtype(block: s_tir.SBlock) -> str | None:
    """The operand dtype (float16 / bfloat16) of a GEMM block reading reduced-precision operands into a
    float32 accumulator, else None."""
    dtypes = {str(region.source.dtype) for region in block.reads}
    if len(dtypes) != 1 or str(block.writes[0].source.dtype) != "float32":
        return None
    dtype = dtypes.pop()
    return dtype if dtype in STORAGE.values() else None


def intrinsics(dtype: str, scope: str = SCOPE) -> dict[str, str]:
    """The wmma intrinsics (init, load_a, load_b, compute, store) for `dtype` operands, B transposed,
    fragments staged in shared memory of `scope`, float32 accumulators."""
    from tvm.s_tir.tensor_intrin import cuda  # registers TVM's float16 intrinsics on import (slow: lazily)

    if dtype == "float16":
        return cuda.get_wmma_intrin_group(scope, scope, "float16", "float32", trans_b=True)
    where = scope.replace(".", "_")
    names = {"init": cuda.WMMA_FILL_16x16x16_F32_INTRIN, "store": f"wmma_store_16x16x16_f32_{where}",
             "load_a": f"souffle_wmma_load_16x16x16_{dtype}_a_{where}",
             "load_b": f"souffle_wmma_load_16x16x16_{dtype}_b_trans_{where}",
             "compute": f"souffle_wmma_sync_16x16x16_{dtype}_f32_trans"}
    f = FRAGMENT
    made = {"load_a": cuda.get_wmma_load_intrin(f, f, f, dtype, scope, False, False),
            "load_b": cuda.get_wmma_load_intrin(f, f, f, dtype, scope, True, True),
            "compute": cuda.get_wmma_sync_intrin(f, f, f, dtype, "float32", True)}
    for key, (desc, impl) in made.items():
        s_tir.TensorIntrin.register(names[key], desc, impl, override=True)
    return names


class TensorCoreRefusal(SouffleError):
    """A GEMM that a wmma schedule does not take, and why (`reduced`: whether its operands are float16 /
    bfloat16 at all, i.e. whether the refusal is news)."""

    def __init__(self, reason: str, reduced: bool = True):
        super().__init__(reason)
        self.reduced = reduced


class OddDepth(TensorCoreRefusal):
    """A depth of an odd number of fragments, for K steps of two."""


class TensorCoreMatmul(GPUScheduleRule):
    """The wmma schedule of a kernel whose one reduction is a GEMM of float16 / bfloat16 operands (its
    element-wise epilogue inlined into the accumulators' write-back). Each block computes a
    (`warps_i` x `frags_i` x 16) x (`warps_j` x `frags_j` x 16) tile, each warp `frags_i` x `frags_j`
    fragments, over K in steps of `k_frags` fragments. `whole`: the function is the kernel (a tiled
    kernel: dynamic shared memory, producers and the epilogue chain inlined); else it is one GEMM stage of
    a grid kernel (`GridTensorCores`), which touches only its own blocks, so that its trace replays on
    the stage inside the kernel (transplant.py)."""

    def __init__(self, warps_i: int = 4, warps_j: int = 4, frags_i: int = 2, frags_j: int = 2, k_frags: int = 4,
                 whole: bool = True):
        self.warps_i, self.warps_j, self.frags_i, self.frags_j, self.k_frags = warps_i, warps_j, frags_i, frags_j, k_frags
        self.whole = whole
        self.scope = SCOPE if whole else "shared"  # grid kernels: static (their launch sets no dynamic size)

    def apply(self, func: tirx.PrimFunc, target, _) -> s_tir.Schedule | None:
        try:
            return self.schedule(func, target)
        except TensorCoreRefusal:  # the next rule takes it
            return None

    def schedule(self, func: tirx.PrimFunc, target) -> s_tir.Schedule:
        """The wmma schedule of `func`; raises TensorCoreRefusal saying why it has none."""
        if not isinstance(func, tirx.PrimFunc) or target.kind.name != "cuda":
            raise TensorCoreRefusal("not a CUDA function")
        sch = s_tir.Schedule(func)
        reductions = get_reduction_blocks(sch, sch.get_child_blocks(get_root_block(sch)))
        if reductions is None or len(reductions) != 1:
            raise TensorCoreRefusal("not one reduction")
        dtype = reduced_dtype(sch.get(reductions[0]))
        if dtype is None:
            raise TensorCoreRefusal("its operands are not float16 / bfloat16 into float32", reduced=False)
        arch = target.attrs.get("arch", "")
        if sm_version(arch) < MIN_ARCH[_precision(dtype)]:
            raise TensorCoreRefusal(f"{arch} has no {dtype} tensor cores")
        if get_index_map(sch.get(reductions[0])) is None:
            raise TensorCoreRefusal("not a GEMM that TVM normalizes to C[b, i, j] += A[b, i, k] * B[b, j, k]")
        try:
            return self._schedule(sch, reductions[0], dtype)
        except TensorCoreRefusal:
            raise
        except Exception as exc:  # accesses that do not normalize or tensorize
            raise TensorCoreRefusal(f"it does not tensorize ({str(exc).strip().splitlines()[-1][:160]})") from exc

    def _check_tiles(self, extents) -> None:
        """Raise TensorCoreRefusal where the GEMM (rows, columns, depth) cannot be scheduled; a kernel of
        its own pads it to whole tiles."""

    def _schedule(self, sch: s_tir.Schedule, main, dtype: str) -> s_tir.Schedule:
        # C[b, i, j] += A[b, i, k] * B[b, j, k], through dlight's reindexing
        reindex_a = sch.reindex(main, ("read", 0))
        reindex_b = sch.reindex(main, ("read", 1))
        reindex_c = sch.reindex(main, ("write", 0))
        matmul_map, a_map, b_map, c_map = get_index_map(sch.get(main))
        sch.transform_layout(reindex_a, ("write", 0), a_map)
        sch.transform_layout(reindex_b, ("write", 0), b_map)
        sch.transform_layout(reindex_c, ("read", 0), c_map)
        sch.transform_block_layout(main, matmul_map)
        self._check_tiles([int(sch.get(loop).extent) for loop in sch.get_loops(main)[-3:]])
        f, warps = FRAGMENT, self.warps_i * self.warps_j
        sch.pad_einsum(main, [1, f * self.warps_i * self.frags_i, f * self.warps_j * self.frags_j,
                              f * self.k_frags])
        batch, i, j, k = sch.get_loops(main)
        i, i_frag = sch.split(i, [None, f])
        j, j_frag = sch.split(j, [None, f])
        k, k_frag = sch.split(k, [None, f])
        sch.reorder(i, j, k, i_frag, j_frag, k_frag)
        inner = main
        outer = sch.blockize(i_frag)
        i_block, i_warp, i_own = sch.split(i, [None, self.warps_i, self.frags_i])
        j_block, j_warp, j_own = sch.split(j, [None, self.warps_j, self.frags_j])
        k_outer, k_inner = sch.split(k, [None, self.k_frags])
        sch.reorder(i_block, j_block, j_warp, i_warp, k_outer, k_inner, i_own, j_own)
        on_block = sch.fuse(i_block, j_block)
        on_warp = sch.fuse(j_warp, i_warp)
        sch.bind(batch, "blockIdx.z")
        sch.bind(on_block, "blockIdx.x")
        sch.bind(on_warp, "threadIdx.y")

        for operand, reindex in ((0, reindex_a), (1, reindex_b)):  # each K step's operand slices, all threads
            staged = sch.cache_read(outer, operand, self.scope)
            sch.compute_at(staged, k_outer)
            fused = sch.fuse(*sch.get_loops(staged)[-2:])
            _, on_y, on_x, lanes = sch.split(fused, [None, warps, WARP, VECTOR])
            sch.bind(on_y, "threadIdx.y")
            sch.bind(on_x, "threadIdx.x")
            sch.vectorize(lanes)
            sch.storage_align(staged, 0, axis=-2, factor=16, offset=8)  # rows padded against bank conflicts
            if self.whole:
                auto_inline_producers(sch, staged)
            else:
                sch.compute_inline(reindex)
        fragments = [sch.cache_read(outer, 0, "wmma.matrix_a"), sch.cache_read(outer, 1, "wmma.matrix_b")]
        for fragment in fragments:
            sch.compute_at(fragment, k_inner)
        through_shared = sch.cache_write(outer, 0, self.scope)
        sch.storage_align(through_shared, 0, -2, 16, 4)
        accumulators = sch.cache_write(outer, 0, "wmma.accumulator")
        sch.reverse_compute_at(accumulators, on_warp)
        sch.reverse_compute_at(through_shared, on_warp)
        si, sj = sch.get_loops(accumulators)[-2:]
        si_outer, si_frag = sch.split(si, [None, f])
        sj_outer, sj_frag = sch.split(sj, [None, f])
        sch.reorder(si_outer, sj_outer, si_frag, sj_frag)
        init = sch.decompose_reduction(outer, k_outer)

        names = intrinsics(dtype, self.scope)
        for fragment, key in zip(fragments, ("load_a", "load_b")):
            fi, fj = sch.get_loops(fragment)[-2:]
            fi_outer, fi_frag = sch.split(fi, [None, f])
            fj_outer, fj_frag = sch.split(fj, [None, f])
            sch.reorder(fi_outer, fj_outer, fi_frag, fj_frag)
            sch.unroll(fi_outer)
            sch.unroll(fj_outer)
            sch.tensorize(fi_frag, names[key])
        init_inner = sch.get_sblock(f"{sch.get(inner).name_hint}_init")
        sch.tensorize(sch.get_loops(init_inner)[-2], names["init"])
        sch.tensorize(sch.get_loops(accumulators)[-2], names["store"])
        sch.tensorize(sch.get_loops(inner)[-3], names["compute"])
        if self.whole:
            auto_inline_consumer_chain(sch, through_shared)  # the epilogue, computed on the way out
        else:
            sch.reverse_compute_inline(reindex_c)
        fused = sch.fuse(*sch.get_loops(through_shared)[-2:])
        _, on_x, lanes = sch.split(fused, [None, WARP, VECTOR])
        sch.bind(on_x, "threadIdx.x")
        sch.vectorize(lanes)
        return sch


class GridTensorCores(TensorCoreMatmul):
    """The tensor-core schedule of a GEMM stage of a grid kernel: the kernel's 8 warps (4 x 2), each 16 x 32
    outputs (1 x 2 fragments), a 64 x 64 tile per block as grid.py's own tile, K in steps of 32 (16 where
    the depth is an odd number of fragments), operands and accumulators staged in static shared memory
    (a cooperative launch sets no dynamic size). Only GEMMs of whole tiles: padding would need operand
    copies of their own, which a grid kernel cannot allocate."""

    def __init__(self, k_frags: int = 2):
        super().__init__(warps_i=4, warps_j=2, frags_i=1, frags_j=2, k_frags=k_frags, whole=False)

    def schedule(self, func, target):
        try:
            return super().schedule(func, target)
        except OddDepth:
            return GridTensorCores(k_frags=1).schedule(func, target)

    def _check_tiles(self, extents) -> None:
        rows, cols, depth = extents
        tile_i, tile_j = FRAGMENT * self.warps_i * self.frags_i, FRAGMENT * self.warps_j * self.frags_j
        if rows % tile_i or cols % tile_j or depth % FRAGMENT:
            raise TensorCoreRefusal(f"its {rows} x {cols} x {depth} GEMM is not whole {tile_i} x {tile_j} x "
                                    f"{FRAGMENT} tiles")
        if depth % (FRAGMENT * self.k_frags):
            raise OddDepth(f"depth {depth}")


def _precision(dtype: str) -> str:
    return {value: key for key, value in STORAGE.items()}[dtype]
