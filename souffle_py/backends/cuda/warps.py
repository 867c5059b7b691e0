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
from tvm import s_tir, te, tirx

from souffle_py.backends.cuda.nest import WARP
from souffle_py.ir.marks import GATE_BLOCKS, GATE_CELL
from souffle_py.ir.graph import isolate

MIN_WARP_TERMS = 64       # reductions from this many terms take a warp per output (>= 2 terms per lane)
WARP_SYNC = "__syncwarp"  # orders a warp's global writes before its lanes read them
SPATIAL, REDUCE = 0, 2


def gate_blocks(block, recurrent) -> int:
    """G for a recurrence step's gate projection marked by te_passes/gate_projections.py (its last axis G
    blocks of units, or already [.., unit, G]); 1 for any other block."""
    if block.name_hint not in recurrent:
        return 1
    return int(block.annotations.get(GATE_BLOCKS, 1))


def is_gate_cell(sch, block, warp_gates) -> bool:
    """Whether `block` is a marked cell update whose gate projections all run a unit's gates in one warp
    (`warp_gates`): it is then mapped a warp per unit, run by the warp's lane 0 after its gates."""
    stmt = sch.get(block)
    if GATE_CELL not in stmt.annotations:
        return False
    gates = [sch.get(p).name_hint for p in sch.get_producers(block) if GATE_BLOCKS in sch.get(p).annotations]
    return bool(gates) and all(name in warp_gates for name in gates)


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
    used, output = [], block.body.buffer.name
    for load in loads:
        if load.source.name != output:  # the accumulator's own read indexes every output axis
            tvm_ffi.structural_walk(load, [(tirx.Var, used.append)])
    # a reduction repeated along an output axis it does not read (a mask's sum broadcast over features)
    # leaves TVM's scope not a stage pipeline once its lanes are bound: one thread per output
    every_axis_read = all(any(v.same_as(iv.var) for v in used) for iv in block.iter_vars
                          if int(iv.iter_type) == SPATIAL and int(iv.dom.extent) > 1)
    return bool(along) and every_axis_read and all(uses_reduce(load.indices[-1]) for load in along)


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
    return bool(lane_reductions(stmt))


def lane_reductions(stmt) -> list[str]:
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
    return [name for name in lane_reductions(lowered.body) if not name.endswith("_in_thread")]


def warp_sync() -> tirx.Stmt:
    return tirx.Evaluate(tirx.call_extern("void", WARP_SYNC))


def shift_outputs(func: tirx.PrimFunc, shifts: dict[str, int], recurrent) -> tirx.PrimFunc:
    """`func` (unscheduled: one loop nest per block under the root) with the outputs of each block named in
    `shifts` moved `shifts[name]` places along the grid: its spatial axes (after a recurrence's time axis)
    flattened into one axis over [0, N + shift), the first `shift` points predicated off and the others
    computing output (point - shift). Split over the grid like any stage, this starts the stage `shift`
    outputs later, on blocks after another stage's, with every block iterator still affine in its loops
    (a rotated block index is a modulo, which TVM's cross-thread reduction does not lower)."""
    realize = func.body
    root = realize.block
    nests = list(root.body.seq) if isinstance(root.body, tirx.SeqStmt) else [root.body]
    moved = [_shifted_nest(nest, shifts, recurrent) for nest in nests]
    body = tirx.SeqStmt(moved) if len(moved) > 1 else moved[0]
    new_root = s_tir.stmt.SBlock(root.iter_vars, root.reads, root.writes, root.name_hint, body, root.init,
                                 root.alloc_buffers, root.match_buffers, root.annotations)
    return tirx.PrimFunc(func.params, s_tir.stmt.SBlockRealize(realize.iter_values, realize.predicate, new_root),
                         func.ret_type, func.attrs)


def _shifted_nest(nest, shifts: dict[str, int], recurrent):
    loops, inner = [], nest
    while isinstance(inner, tirx.For):
        loops.append(inner)
        inner = inner.body
    if not isinstance(inner, s_tir.stmt.SBlockRealize) or inner.block.name_hint not in shifts:
        return nest
    block, shift = inner.block, shifts[inner.block.name_hint]
    lead = 1 if block.name_hint in recurrent else 0
    ivs, values = list(block.iter_vars), list(inner.iter_values)
    spatial = [i for i in range(lead, len(ivs)) if int(ivs[i].iter_type) == SPATIAL]
    if spatial != list(range(lead, lead + len(spatial))) or len(loops) != len(ivs) \
            or not all(value.same_as(loop.loop_var) for value, loop in zip(values, loops)):
        return nest  # not the plain nest of an unscheduled TE block: left as it is
    extents = [int(ivs[i].dom.extent) for i in spatial]
    gates = gate_blocks(block, recurrent)
    if gates > 1:  # an LSTM step's gates [.., g * H + u]: units flattened, the gate kept as its own axis
        extents[-1] //= gates
    flat_loop, gate_loop = tirx.Var("flat", "int32"), tirx.Var("gate", "int32")
    flat = tirx.IterVar(tvm.ir.Range(0, prod(extents) + shift), tirx.Var("v_flat", "int32"), SPATIAL)
    gate = tirx.IterVar(tvm.ir.Range(0, gates), tirx.Var("v_gate", "int32"), SPATIAL)
    point, index, stride = flat.var - shift, {}, prod(extents)
    for n, (i, extent) in enumerate(zip(spatial, extents)):
        stride //= extent  # truncating division: the predicate keeps every computed point >= 0, and CUDA
        row = tirx.truncdiv(point, stride) if stride > 1 else point  # then needs no sign fix-ups
        index[ivs[i].var.__chandle__()] = row if n == 0 else tirx.truncmod(row, extent)
    if gates > 1:
        index[ivs[spatial[-1]].var.__chandle__()] = gate.var * extents[-1] + index[ivs[spatial[-1]].var.__chandle__()]

    def moved(node):
        return tvm_ffi.structural_map(node, [(tirx.Var, lambda v: index.get(v.__chandle__(), v))])

    kept = [i for i in range(len(ivs)) if i not in spatial]
    gated = [gate] if gates > 1 else []
    new_block = s_tir.stmt.SBlock([*ivs[:lead], flat, *gated, *(ivs[i] for i in kept[lead:])],
                                  [moved(r) for r in block.reads], [moved(w) for w in block.writes],
                                  block.name_hint, moved(block.body), moved(block.init) if block.init else None,
                                  block.alloc_buffers, block.match_buffers, block.annotations)
    new_values = [*values[:lead], flat_loop, *([gate_loop] if gated else []), *(values[i] for i in kept[lead:])]
    predicate = flat_loop >= shift
    if not (isinstance(inner.predicate, tirx.IntImm) and int(inner.predicate)):
        predicate = tirx.And(inner.predicate, predicate)
    stmt = s_tir.stmt.SBlockRealize(new_values, predicate, new_block)
    new_loops = [*loops[:lead], (flat_loop, prod(extents) + shift), *([(gate_loop, gates)] if gated else []),
                 *(loops[i] for i in kept[lead:])]
    for loop in reversed(new_loops):
        stmt = tirx.For(loop[0], 0, loop[1], tirx.ForKind.SERIAL, stmt) if isinstance(loop, tuple) else \
            tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind, stmt, loop.thread_binding, loop.annotations)
    return stmt


def warp_per_output(op) -> bool:
    """Whether grid.py gives `op` a warp per output (decided on its block, the op alone)."""
    inputs, outputs = isolate(op)
    blocks = []
    tvm_ffi.structural_walk(te.create_prim_func([*inputs, *outputs]).body, [(s_tir.stmt.SBlock, blocks.append)])
    return any(warp_reduced(block) for block in blocks if block.name_hint != "root")
