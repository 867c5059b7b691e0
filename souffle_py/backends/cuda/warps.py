"""Warp-per-output reductions inside grid kernels (grid.py): which stages get them, and the checks and
workarounds that TVM 0.27's cross-thread reduction lowering needs.

A reduction whose operands are read along their last (contiguous) index takes a warp per output: its
lanes read adjacent terms and combine their partial sums with warp shuffles (TVM's LowerCrossThreadReduction
and LowerThreadAllreduce), without shared memory or __syncthreads. Lane 0 writes the result; a stage that
reads it in the same warp waits at __syncwarp.
"""

from __future__ import annotations

from math import prod

import tvm
import tvm_ffi
from tvm import s_tir, tirx

WARP = 32                 # lanes of a warp: threadIdx.x
MIN_WARP_TERMS = 64       # reductions from this many terms take a warp per output (>= 2 terms per lane)
WARP_SYNC = "__syncwarp"  # orders a warp's global writes before its lanes read them
SPATIAL, REDUCE = 0, 2


def warp_reduced(block) -> bool:
    """A reduction of at least MIN_WARP_TERMS terms into one buffer, by a combiner TVM's cross-thread
    reduction knows: one warp per output."""
    terms = prod(int(iv.dom.extent) for iv in block.iter_vars if int(iv.iter_type) == REDUCE)
    return any(int(iv.iter_type) == REDUCE for iv in block.iter_vars) and terms >= MIN_WARP_TERMS \
        and len(block.writes) == 1 and _known_combiner(block) and _lanes_read_adjacent(block)


def _lanes_read_adjacent(block) -> bool:
    """Every operand read along the reduction has it in its last (contiguous) index, so a warp's lanes
    read adjacent elements: a GEMV's weight rows, a layer norm's rows, Q.K^T. A GEMM-like reduction over
    an operand's rows (x.W with W[k, j]) is coalesced across outputs instead: one thread per output."""
    reduce = [iv.var for iv in block.iter_vars if int(iv.iter_type) == REDUCE]

    def uses_reduce(expr) -> bool:
        found = []
        tvm_ffi.structural_walk(expr, [(tirx.Var, lambda v: found.append(any(v.same_as(r) for r in reduce)))])
        return any(found)

    loads = []
    tvm_ffi.structural_walk(block.body.value, [(tvm.ir.expr.TensorLoad, loads.append)])
    along = [load for load in loads if any(uses_reduce(i) for i in load.indices)]
    return bool(along) and all(uses_reduce(load.indices[-1]) for load in along)


def _known_combiner(block) -> bool:
    """A sum from 0, a max from the type's lowest value or a min from its highest: the reducers whose
    identities TVM's cross-thread reduction matches (a max from -inf, as softmax's, it does not)."""
    init, update = block.init, block.body
    if not (isinstance(init, tirx.BufferStore) and isinstance(update, tirx.BufferStore)):
        return False
    identity, value = init.value, update.value
    if not isinstance(identity, (tirx.FloatImm, tirx.IntImm)):
        return False
    dtype = str(identity.ty)
    identities = {tirx.Add: 0, tirx.Max: tvm.tirx.min_value(dtype).value, tirx.Min: tvm.tirx.max_value(dtype).value}
    expected = identities.get(type(value))
    return expected is not None and identity.value == expected



def guarded_write_backs(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """Warp reductions whose predicate is a single clause get a second, always true, one on the lane.

    TVM 0.27's LowerCrossThreadReduction guards the write-back of a cross-thread reduction with the
    clauses of the block's predicate that do not involve the reduction, but it looks only inside `and`
    nodes: a predicate of one clause (the grid-stride bound `output < N`, when the reduction splits
    evenly into lanes) is dropped, and blocks past the last output write out of bounds."""
    lanes = []
    tvm_ffi.structural_walk(func.body, [(tirx.For, lambda f: lanes.append(f.loop_var) if f.thread_binding is not None
                                         and str(f.thread_binding.thread_tag) == "threadIdx.x" else None)])

    def lane_of(realize):
        for iv, value in zip(realize.block.iter_vars, realize.iter_values):
            if int(iv.iter_type) == REDUCE:
                used = []
                tvm_ffi.structural_walk(value, [(tirx.Var, lambda v: used.extend(l for l in lanes if l.same_as(v)))])
                if used:
                    return used[0]
        return None

    def guard(realize):
        lane = lane_of(realize)
        predicate = realize.predicate
        if lane is None or isinstance(predicate, tirx.And) or (isinstance(predicate, tirx.IntImm) and int(predicate)):
            return realize
        return s_tir.stmt.SBlockRealize(realize.iter_values, tirx.And(predicate, lane < WARP), realize.block)

    return tvm_ffi.structural_map(func, [(s_tir.stmt.SBlockRealize, guard)])



def has_warp_reduction(stmt) -> bool:
    """Whether a stage reduces across the lanes of a warp (a reduction iterator bound to its lane loop)."""
    return bool(_lane_reductions(stmt))


def _lane_reductions(stmt) -> list[str]:
    """Names of the blocks inside `stmt` with a reduction iterator bound to a lane (threadIdx.x) loop."""
    lanes, found = [], []
    tvm_ffi.structural_walk(stmt, [(tirx.For, lambda f: lanes.append(f.loop_var) if f.thread_binding is not None
                                    and str(f.thread_binding.thread_tag) == "threadIdx.x" else None)])

    def uses_lane(value) -> bool:
        hits = []
        tvm_ffi.structural_walk(value, [(tirx.Var, lambda v: hits.append(any(v.same_as(l) for l in lanes)))])
        return any(hits)

    def visit(realize):
        if any(int(iv.iter_type) == REDUCE and uses_lane(value)
               for iv, value in zip(realize.block.iter_vars, realize.iter_values)):
            found.append(realize.block.name_hint)

    tvm_ffi.structural_walk(stmt, [(s_tir.stmt.SBlockRealize, visit)])
    return found


def unlowered_warp_reductions(func: tirx.PrimFunc) -> list[str]:
    """Blocks with a reduction over lanes that TVM's LowerCrossThreadReduction leaves as they are (it
    needs affine block iterators, among others): each lane would add into the output unsynchronized."""
    lowered = s_tir.transform.LowerCrossThreadReduction()(tvm.IRModule({"main": func}))["main"]
    return [name for name in _lane_reductions(lowered.body) if not name.endswith("_in_thread")]


def warp_sync() -> tirx.Stmt:
    return tirx.Evaluate(tirx.call_extern("void", WARP_SYNC))
