"""Rule-based default CPU schedules, applied to every sblock of a PrimFunc by its kind.

- GEMM-like (one reduction axis, two or more spatial axes, a product of two loads): register tiles of
  TILE_I x TILE_J accumulated in a local buffer, the j tile vectorized, outer tiles parallel.
- Other reductions (softmax/layernorm rows, means): parallel over the spatial axes, reduction innermost.
- Injective (elementwise, broadcast, reshape, transpose...): all loops fused, parallel + vectorized.
Untuned code is 50-100x slower than ONNX Runtime on BERT here, so even the default must be a real
schedule; MetaSchedule (later) replaces these where it has tuned records.
"""

from __future__ import annotations

import logging

import tvm
from tvm import s_tir, tirx

log = logging.getLogger(__name__)

VECTOR = 8            # float32 lanes of AVX2
TILE_I = 4            # rows of the register tile
TILE_J = 16           # columns of the register tile (two vectors): 4x2 accumulators + loads fit 16 ymm
PARALLEL_MIN = 4096   # below this many points a parallel launch costs more than it saves


def schedule_cpu(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` with a default schedule on each of its sblocks (unchanged blocks where a rule does not fit)."""
    sch = s_tir.Schedule(func)
    for block in _leaf_blocks(sch):
        kind = block_kind(sch, block)
        trial = sch.copy()  # a rule that does not fit leaves the block as it was, never breaks the build
        try:
            RULES[kind](trial, block)
            sch = trial
        except Exception as exc:
            log.debug("default %s schedule skipped for %s: %s", kind, sch.get(block).name_hint, exc)
    return sch.mod["main"]


def _leaf_blocks(sch):
    return list(sch.get_child_blocks(sch.get_sblock("root")))


def block_kind(sch, block) -> str:
    """'gemm', 'reduction' or 'injective', from the block's iteration types and body."""
    stmt = sch.get(block)
    reduce_vars = [iv for iv in stmt.iter_vars if int(iv.iter_type) == 2]
    spatial_vars = [iv for iv in stmt.iter_vars if int(iv.iter_type) == 0]
    if not reduce_vars:
        return "injective"
    if len(reduce_vars) == 1 and len(spatial_vars) >= 2 and _is_product_of_loads(stmt.body):
        return "gemm"
    return "reduction"


def _is_product_of_loads(body) -> bool:
    """C[..] = C[..] + A[..] * B[..]: the update of a matrix product."""
    if not isinstance(body, tirx.BufferStore) or not isinstance(body.value, tirx.Add):
        return False
    product = body.value.b
    return isinstance(product, tirx.Mul) and all(isinstance(x, tvm.ir.expr.TensorLoad) for x in (product.a, product.b))


def _extent(sch, loop) -> int:
    return int(sch.get(loop).extent)


def _largest_divisor(n: int, candidates) -> int:
    return next((c for c in candidates if n % c == 0), 1)


def _gemm(sch, block) -> None:
    *outer, i, j, k = sch.get_loops(block)
    tile_i = _largest_divisor(_extent(sch, i), (TILE_I, 3, 2))
    tile_j = _largest_divisor(_extent(sch, j), (TILE_J, VECTOR))
    io, ii = sch.split(i, [None, tile_i])
    jo, ji = sch.split(j, [None, tile_j])
    sch.reorder(*outer, io, jo, k, ii, ji)
    acc = sch.cache_write(block, 0, "local")
    sch.reverse_compute_at(acc, jo)
    # loop annotations first: parallel/vectorize refuse a reduction block whose init was split off
    if tile_j >= VECTOR:
        sch.vectorize(ji)
        sch.vectorize(sch.get_loops(acc)[-1])
    sch.unroll(ii)
    outer_fused = sch.fuse(*outer, io, jo)
    if _extent(sch, outer_fused) > 1:
        sch.parallel(outer_fused)
    sch.decompose_reduction(block, k)


def _reduction(sch, block) -> None:
    loops = sch.get_loops(block)
    stmt = sch.get(block)
    n_spatial = sum(1 for iv in stmt.iter_vars if int(iv.iter_type) == 0)
    spatial = loops[:n_spatial]
    if not spatial:
        return
    fused = sch.fuse(*spatial) if len(spatial) > 1 else spatial[0]
    total = _extent(sch, fused)
    for loop in loops[n_spatial:]:
        total *= _extent(sch, loop)
    if _extent(sch, fused) > 1 and total >= PARALLEL_MIN:
        sch.parallel(fused)


def _injective(sch, block) -> None:
    loops = sch.get_loops(block)
    if not loops:
        return
    fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    extent = _extent(sch, fused)
    if extent % VECTOR == 0 and extent >= VECTOR:
        outer, inner = sch.split(fused, [None, VECTOR])
        sch.vectorize(inner)
    else:
        outer = fused
    if extent >= PARALLEL_MIN:
        sch.parallel(outer)


RULES = {"gemm": _gemm, "reduction": _reduction, "injective": _injective}
