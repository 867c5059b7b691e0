"""Tensor-core GEMM stages inside grid kernels: what their transplanted schedules (transplant.py, of
tensor_cores.GridTensorCores) leave until the whole kernel is scheduled.

- Tensorize: a tensorized block reads and writes its fragments opaquely, which the scheduling of the
  kernel's other stages (cache reads, compute-at: a stage pipeline) does not admit. The replayed trace
  marks each loop it tensorized (TENSORIZE), and `tensorize_marked` tensorizes them last; the reduction's
  init, which exists only once transplant.decompose_marked splits it off, is marked there.
- Tiles: a stage takes its 64 x 64 tiles in a grid-stride loop over the kernel's blocks (TILES). TVM's
  tensorize takes no fragment load under a predicate, and a condition around the tile would hold its
  __syncthreads, which TVM does not insert inside a condition: `per_block_tiles` instead drops the
  tiles' predicates before tensorizing and makes the loop run, per block, over that block's own tiles.
  The count is the same for all the block's warps, so they reach the wmma intrinsics together or not
  at all.
"""

from __future__ import annotations

import tvm_ffi
from tvm import s_tir, tirx

from souffle_py.schedule.stages import STAGE

TENSORIZE = "souffle.tensorize"   # loop annotation: the tensor intrinsic the stage's schedule put there
TILES = "souffle.tiles"           # loop annotation: a tensor-core stage's grid-stride loop: its tile count


def tensorized_init(insts) -> tuple[str, set]:
    """(the intrinsic that a tensor-core schedule tensorizes its reduction's init with, the random
    variables of the instructions that find the init's loop): the init exists only once the reduction is
    decomposed, which transplant.decompose_marked does, marking the init for tensorize_marked."""
    init = f"{STAGE}_init"
    found = {o for kind, _, attrs, outputs in insts if kind == "GetSBlock" and str(attrs[0]) == init for o in outputs}
    loops = {o for kind, inputs, _, outputs in insts if kind == "GetLoops" and inputs[0] in found for o in outputs}
    fills = [str(attrs[0]) for kind, inputs, attrs, _ in insts if kind == "Tensorize" and inputs[0] in loops]
    return (fills[0] if fills else ""), found | loops


def tensorize_marked(sch) -> None:
    """Tensorize the loops the transplanted schedules marked (TENSORIZE), once the whole kernel is
    scheduled."""
    names = []
    tvm_ffi.structural_walk(sch.mod["main"].body, [(s_tir.stmt.SBlock, lambda b: names.append(b.name_hint))])
    for name in dict.fromkeys(names):
        try:
            loops = sch.get_loops(sch.get_sblock(name))
        except Exception:  # a block a tensorized loop above it replaced
            continue
        marked = [loop for loop in loops if TENSORIZE in sch.get(loop).annotations]
        if marked:
            intrin = str(sch.get(marked[-1]).annotations[TENSORIZE])
            sch.unannotate(marked[-1], TENSORIZE)
            sch.tensorize(marked[-1], intrin)


def per_block_tiles(func: tirx.PrimFunc, counts: bool) -> tirx.PrimFunc:
    """Each tensor-core stage's grid-stride loop (TILES) run per block only over the block's own tiles
    (tile = counter x grid + block index < tiles): before tensorizing (`counts` False), its blocks' tile
    predicates dropped; after (`counts` True: tensorize finds no iterators under a loop of a symbolic
    extent), the loop's extent made the block's count of tiles."""
    def visit(loop):
        if loop.thread_binding is None or str(loop.thread_binding.thread_tag) != "blockIdx.x":
            return loop
        block_var, blocks = loop.loop_var, loop.extent

        def per_block(inner):
            if TILES not in inner.annotations:
                return inner
            if not counts:
                body = _without_clauses_over(inner.body, {block_var.__chandle__(), inner.loop_var.__chandle__()})
                if isinstance(inner.extent, tirx.IntImm) and int(inner.extent) == 1:
                    # one turn (no more tiles than blocks): its counter is 0, and the tile index the block's
                    # alone, which TVM's tensorize (its blockize) can divide into rows and columns of
                    # tiles; (0 * blocks + block) // columns it could not (a GEMM of two rows of tiles)
                    body = tvm_ffi.structural_map(body, [(tirx.Var, lambda v: tirx.const(0, str(v.ty))
                                                          if v.same_as(inner.loop_var) else v)])
                return tirx.For(inner.loop_var, inner.min, inner.extent, inner.kind, body, inner.thread_binding,
                                inner.annotations)
            tiles = int(inner.annotations[TILES])
            annotations = {k: v for k, v in inner.annotations.items() if k != TILES}
            turns = tirx.floordiv(tiles - block_var + blocks - 1, blocks)
            return tirx.For(inner.loop_var, inner.min, turns, inner.kind, inner.body, inner.thread_binding, annotations)

        return tvm_ffi.structural_map(loop, [(tirx.For, per_block)])

    return tvm_ffi.structural_map(func, [(tirx.For, visit)])


def _without_clauses_over(stmt, variables: set):
    """`stmt` with the clauses of its blocks' predicates that read only `variables` dropped."""
    def strip(realize):
        kept = [c for c in clauses(realize.predicate) if not _reads_only(c, variables)]
        predicate = kept[0] if kept else tirx.const(True, "bool")
        for clause in kept[1:]:
            predicate = tirx.And(predicate, clause)
        return s_tir.stmt.SBlockRealize(realize.iter_values, predicate, realize.block)

    return tvm_ffi.structural_map(stmt, [(s_tir.stmt.SBlockRealize, strip)])


def clauses(predicate) -> list:
    """The conjuncts of a block predicate (none for True)."""
    if isinstance(predicate, tirx.And):
        return clauses(predicate.a) + clauses(predicate.b)
    return [] if isinstance(predicate, tirx.IntImm) else [predicate]


def _reads_only(expr, variables: set) -> bool:
    used = []
    tvm_ffi.structural_walk(expr, [(tirx.Var, lambda v: used.append(v.__chandle__()))])
    return bool(used) and set(used) <= variables
