"""Grid barriers of a grid-synchronized kernel (grid.py): where they go, in which order the stages run
between them, and how each phase's stages spread over the grid.

A `tirx.cuda.grid_sync` (cooperative groups' grid barrier) goes before each stage that reads what an
earlier stage wrote since the last barrier, unless every such read is of an element the same thread (or,
after a warp reduction, the same warp: a __syncwarp) wrote: the store and load indices are equal
functions of the block, thread and loop counters. A recurrence's time step ends with a barrier. Stages
run level by level (the barriers each needs), and the stages of one phase start on different blocks.
"""

from __future__ import annotations

from math import prod

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.sym import Analyzer

from souffle_py.backends.cuda.launches import child_statements
from souffle_py.backends.cuda.nest import THREADS, TILE, WARPS
from souffle_py.backends.cuda.warps import SPATIAL, has_warp_reduction, lane_reductions, warp_sync
from souffle_py.codegen.recurrence import TIME_LOOP
from souffle_py.ir.exprs import substitute
from souffle_py.ir.marks import GATE_CELL

GRID_SYNC = "tirx.cuda.grid_sync"
MAX_SERIAL = 4            # a serial loop this short inside a stage's thread nest counts as that thread's
_ANALYZER = Analyzer()


def _sync() -> tirx.Stmt:
    return tirx.Evaluate(tirx.call_intrin("void", GRID_SYNC))


def _is_time_loop(stmt) -> bool:
    return isinstance(stmt, tirx.For) and TIME_LOOP in stmt.annotations


def insert_grid_syncs(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """A grid barrier before each stage that reads what an earlier stage wrote since the last barrier
    (unless every such read is of an element the same thread wrote), and at the end of each time step."""

    def visit(loop):
        warps = _warp_loop(loop)
        if warps is None:
            return loop
        body = _seq(_synced(_statements(warps.body), end_of_step=False))
        return _with_body(loop, _with_body(warps, body))

    try:
        return tvm_ffi.structural_map(func, [(tirx.For, visit)])
    finally:
        _forget()


def spread_phases(func: tirx.PrimFunc, rotation: "Rotation | None" = None) -> tirx.PrimFunc:
    """Spread the stages of each phase (the code between two grid barriers) over the grid: a stage starts
    at the block after the last one the previous stages of its phase use, so independent small stages
    (the wavefront's per-layer GEMVs: 19 of 4 blocks each) run on different SMs at once instead of all on
    blocks 0-3. A stage's blocks are rotated, a bijection, so every element is still computed once;
    stages linked by reads inside a phase share one rotation (the barrier analysis proved those reads
    same-thread, and they must stay so). A group with a warp reduction is not rotated (a rotated block
    index is not affine, and TVM would not lower the shuffles): `rotation` records its stages' shifts,
    for warps.shift_outputs to move their outputs instead, before the kernel is scheduled again with the
    same offsets."""

    def visit(loop):
        warps = _warp_loop(loop)
        if warps is None:
            return loop
        rotate = rotation or Rotation(int(loop.extent))
        rotate.block_var = loop.loop_var
        return _with_body(loop, _with_body(warps, _seq(rotate.phases(_statements(warps.body)))))

    try:
        return tvm_ffi.structural_map(func, [(tirx.For, visit)])
    finally:
        _forget()


def _warp_loop(loop):
    """The warp loop (threadIdx.y) directly inside a grid kernel's block loop (blockIdx.x), else None: its
    body is the kernel's stages."""
    tag = loop.thread_binding.thread_tag if loop.thread_binding is not None else ""
    inner = loop.body
    if str(tag) != "blockIdx.x" or not (isinstance(inner, tirx.For) and inner.thread_binding is not None
                                        and str(inner.thread_binding.thread_tag) == "threadIdx.y"):
        return None
    return inner


def _with_body(loop, body):
    return tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind, body, loop.thread_binding, loop.annotations)


class Rotation:
    """Block offsets of the stages of each phase (spread_phases): `offsets` by stage (its first block's
    name; given: those of a previous pass), `shifts` (in output elements) by block of the groups with a
    warp reduction, which move by their outputs instead of being rotated."""

    def __init__(self, blocks: int, offsets: dict | None = None):
        self.block_var, self.blocks, self.given = None, blocks, offsets is not None
        self.offsets: dict[str, int] = dict(offsets or {})
        self.shifts: dict[str, int] = {}

    def phases(self, stmts: list) -> list:
        out, phase = [], []   # phase: the statements since the last barrier
        for stmt in stmts:
            if _is_sync(stmt) or _is_time_loop(stmt):
                out += self._spread(phase)
                phase = []
                if _is_time_loop(stmt):
                    stmt = tirx.For(stmt.loop_var, stmt.min, stmt.extent, stmt.kind,
                                    _seq(self.phases(_statements(stmt.body))), stmt.thread_binding, stmt.annotations)
                out.append(stmt)
            else:
                phase.append(stmt)
        return out + self._spread(phase)

    def _spread(self, phase: list) -> list:
        """The statements of one phase rotated: statements linked by reads inside the phase (which the
        barrier analysis proved same-thread) form one group with one rotation, groups one after another."""
        group = list(range(len(phase)))

        def root(i):
            while group[i] != i:
                group[i] = group[group[i]]
                i = group[i]
            return i

        for j, stmt in enumerate(phase):
            for i in range(j):
                if _reads_from(phase[i], stmt):
                    group[root(j)] = root(i)
        offsets, next_block = {}, 0
        for i, stmt in enumerate(phase):
            if root(i) not in offsets:
                members = [other for k, other in enumerate(phase) if root(k) == root(i)]
                if self.given:
                    offsets[root(i)] = self.offsets.get(_stage_key(stmt), 0)
                    continue
                offsets[root(i)] = next_block
                next_block = (next_block + max(self._blocks_used(m) for m in members)) % self.blocks
                self.offsets[_stage_key(stmt)] = offsets[root(i)]
        with_warps = {root(i) for i, stmt in enumerate(phase) if lane_reductions(stmt)}
        out = []
        for i, stmt in enumerate(phase):
            if root(i) in with_warps:  # the group moves by its outputs (warps.shift_outputs), or has moved
                per_block = _per_block(stmt)
                if per_block != TILE * TILE:  # (a tiled GEMM keeps its blocks: correct, only not spread)
                    self.shifts.update({name: offsets[root(i)] * per_block for name in _block_names(stmt)})
                out.append(stmt)
            else:
                out.append(self._rotated(stmt, offsets[root(i)]))
        return out

    def _blocks_used(self, stmt) -> int:
        """Blocks the stage's first grid-stride round occupies: one per THREADS elements, per WARPS outputs
        of a warp-reduced stage, per tile of a GEMM staged through shared memory (elements: its block's
        spatial axes spread over the grid, not the time step)."""
        elements = 1

        def spread(value) -> bool:
            found = []
            tvm_ffi.structural_walk(value, [(tirx.Var, lambda v: found.append(v.same_as(self.block_var)))])
            return any(found)

        def visit(realize):
            nonlocal elements
            extents = [int(iv.dom.extent) for iv, value in zip(realize.block.iter_vars, realize.iter_values)
                       if int(iv.iter_type) == SPATIAL and spread(value)]
            elements = max(elements, prod(extents))

        tvm_ffi.structural_walk(stmt, [(s_tir.stmt.SBlockRealize, visit)])
        return max(1, min(self.blocks, -(-elements // _per_block(stmt))))

    def _rotated(self, stmt, offset: int):
        if offset == 0:
            return stmt
        rotated = tirx.floormod(self.block_var + (self.blocks - offset), self.blocks)
        return tvm_ffi.structural_map(stmt, [(tirx.Var, lambda v: rotated if v.same_as(self.block_var) else v)])


def _per_block(stmt) -> int:
    """Output elements a block computes per grid-stride round of a stage: a tile of a GEMM staged through
    shared memory, a warp's output for each warp of a warp reduction or of a cell update after one, else a
    thread's."""
    tiled, cell, lanes = [], [], []
    tvm_ffi.structural_walk(stmt, [(tirx.BufferStore, lambda s: tiled.append(str(s.buffer.scope()) == "shared")),
                                   (s_tir.stmt.SBlock, lambda b: cell.append(GATE_CELL in b.annotations)),
                                   (tirx.For, lambda f: lanes.append(f.thread_binding is not None))])
    warp_cell = any(cell) and not any(lanes)  # mapped a warp per unit (grid.py), no lane loop of its own
    return TILE * TILE if any(tiled) else WARPS if has_warp_reduction(stmt) or warp_cell else THREADS


def _stage_key(stmt) -> str:
    """A stage statement's name across passes: the first of its blocks' names."""
    names = _block_names(stmt)
    return min(names) if names else ""


def _block_names(stmt) -> list[str]:
    names = []
    tvm_ffi.structural_walk(stmt, [(s_tir.stmt.SBlockRealize, lambda r: names.append(r.block.name_hint))])
    return names


def _is_sync(stmt) -> bool:
    return isinstance(stmt, tirx.Evaluate) and isinstance(stmt.value, tvm.ir.Call) \
        and isinstance(stmt.value.op, tvm.ir.Op) and stmt.value.op.name == GRID_SYNC


def _reads_from(producer, consumer) -> bool:
    written = _stores(producer)
    return any(name in written for name, _ in _loads(consumer))


def _seq(stmts: list):
    return stmts[0] if len(stmts) == 1 else tirx.SeqStmt(stmts)


def _statements(stmt) -> list:
    return list(stmt.seq) if isinstance(stmt, tirx.SeqStmt) else [stmt]


def _synced(stmts, end_of_step: bool) -> list:
    out, pending = [], []   # pending: statements since the last barrier
    for stmt in barrier_order(stmts):
        if any(_needs_barrier(earlier, stmt) for earlier in pending):
            out.append(_sync())
            pending = []
        elif any(_reads_from(earlier, stmt) and has_warp_reduction(earlier) for earlier in pending):
            out.append(warp_sync())  # a warp reduction's lane 0 wrote what all the warp's lanes now read
        if _is_time_loop(stmt):
            body = _seq(_synced(_statements(stmt.body), end_of_step=True))
            stmt = tirx.For(stmt.loop_var, stmt.min, stmt.extent, stmt.kind, body, stmt.thread_binding,
                            stmt.annotations)
        out.append(stmt)
        pending.append(stmt)
    if end_of_step:  # the next step reads this one's results, computed by other blocks
        out.append(_sync())
    return out


def barrier_order(stmts: list) -> list:
    """The stages in an order with as few barriers between them as their dependences allow: each stage's
    level is how many barriers must precede it (one more than a stage it reads across threads, the same
    as one it reads within its own thread), and the stages run level by level, in program order inside a
    level. Independent stages (the layers of a wavefront step, parallel branches) so share their phase.
    Every pair of stages that touch a common element keeps its order, so the result is the same."""
    levels: list[int] = []
    for j, stmt in enumerate(stmts):
        level = 0
        for i in range(j):
            barriers = _dependence(stmts[i], stmt)
            if barriers is not None:
                level = max(level, levels[i] + barriers)
        levels.append(level)
    return [stmts[j] for j in sorted(range(len(stmts)), key=lambda j: (levels[j], j))]


def _dependence(first, second) -> int | None:
    """None if the statements touch no common element that one of them writes; else the barriers needed
    between them: 0 for a read of elements the same thread wrote, 1 otherwise (a read of other threads'
    writes, or a write of what `first` read or wrote: conservatively a barrier)."""
    stores_first, stores_second = _stores(first), _stores(second)
    if _overlap(stores_second, _loads(first), second, first) or \
            _overlap(stores_first, [(n, i) for n, all_i in stores_second.items() for i in all_i], first, second):
        return 1
    if not _overlap(stores_first, _loads(second), first, second):
        return None
    return 1 if _needs_barrier(first, second) else 0


def _overlap(written: dict, accessed: list, writer, accessor) -> bool:
    return any(name in written and not _other_steps(written[name], indices, writer, accessor)
               for name, indices in accessed)


def _needs_barrier(producer, consumer) -> bool:
    """Whether `consumer` reads a buffer `producer` writes at an element another thread may have written."""
    written = _stores(producer)
    for name, indices in _loads(consumer):
        if name in written and not _same_thread(written[name], indices, producer, consumer, name) \
                and not _other_steps(written[name], indices, producer, consumer):
            return True
    return False


def _other_steps(stores, indices, producer, consumer) -> bool:
    """Every store's leading index differs from the access's by a nonzero constant (one time step of a
    recurrence reading the previous step's slot): they never touch a common element."""
    if not stores or not len(indices):
        return False
    access = _bound(consumer, indices[0])
    for store in stores:
        difference = _ANALYZER.simplify(_bound(producer, store[0]) - access)
        if not (isinstance(difference, tirx.IntImm) and int(difference) != 0):
            return False
    return True


_ACCESSES: dict = {}  # statement handle -> (statement, stores, loads, bindings), while one function is analysed


def _accesses(stmt):
    """(stores by buffer name, loads, block variable bindings) of a statement, walked once per statement
    during `insert_grid_syncs` and `spread_phases` (the barrier order compares every pair of stages)."""
    key = stmt.__chandle__()
    if key not in _ACCESSES:
        stores, loads, bindings, guards = {}, [], {}, {}

        def realize(r):
            bindings.update({iv.var.__chandle__(): value for iv, value in zip(r.block.iter_vars, r.iter_values)})
            tvm_ffi.structural_walk(r.block, [(tirx.BufferStore, lambda s: guards.setdefault(
                s.buffer.name, []).append((s.indices, r.predicate)))])

        tvm_ffi.structural_walk(stmt, [
            (tirx.BufferStore, lambda s: stores.setdefault(s.buffer.name, []).append(s.indices)),
            (tvm.ir.expr.TensorLoad, lambda l: loads.append((l.source.name, l.indices))),
            (s_tir.stmt.SBlockRealize, realize)])
        _ACCESSES[key] = (stmt, stores, loads, bindings, guards)  # the statement kept alive: its handle stays unique
    return _ACCESSES[key][1:]


def _stores(stmt) -> dict:
    return _accesses(stmt)[0]


def _loads(stmt) -> list:
    return _accesses(stmt)[1]


def _same_thread(stores, load_indices, producer, consumer, name: str = "") -> bool:
    """Each thread reads only elements it wrote itself: the producer writes the buffer at exactly the
    indices the consumer reads, as functions of the same block, thread and grid-stride loop counters,
    and every thread that reads an element wrote it (`_writers_guarded`)."""
    if _is_time_loop(producer) or _is_time_loop(consumer) or not stores:
        return False
    canonical_load = _canonical(consumer, load_indices)
    simplified_load = [_ANALYZER.simplify(index) for index in canonical_load]
    return all(any(tvm_ffi.structural_equal(instance, load)
                   for instance in _serial_instances(producer, _canonical(producer, s))
                   for load in (canonical_load, simplified_load)) for s in stores) \
        and _writers_guarded(producer, consumer, name)


def _writers_guarded(producer, consumer, name: str) -> bool:
    """No store of `name` is guarded by a counter its indices do not use (block, warp, grid-stride: a
    warp reduction's lane is the warp's, after a __syncwarp) unless every block of the consumer has the
    same guard: an element that many threads index alike but only some write (a norm of one element,
    [1, 1], written by warp 0 of block 0 and read by warp 1) is another thread's write to the others."""
    lanes_synced = has_warp_reduction(producer)
    read_guards = [_canonical(consumer, [clause])[0]
                   for r in _realizes(consumer) for clause in _predicate_clauses(r.predicate)]
    for indices, predicate in _accesses(producer)[3].get(name, []):
        used = _counters_in(_canonical(producer, list(indices)))
        for clause in _predicate_clauses(predicate):
            canonical = _canonical(producer, [clause])[0]
            extra = _counters_in([canonical]) - used
            if lanes_synced:
                extra = {v for v in extra if not v.endswith("threadIdx_x")}
            if extra and not any(tvm_ffi.structural_equal(canonical, g) for g in read_guards):
                return False
    return True


def _realizes(stmt) -> list:
    found = []
    tvm_ffi.structural_walk(stmt, [(s_tir.stmt.SBlockRealize, found.append)])
    return found


def _predicate_clauses(predicate) -> list:
    if isinstance(predicate, tirx.And):
        return _predicate_clauses(predicate.a) + _predicate_clauses(predicate.b)
    return [] if isinstance(predicate, tirx.IntImm) else [predicate]


def _counters_in(exprs) -> set:
    """Names of the loop counters (canonical or not: the block and warp loops outside the stage) in `exprs`."""
    found = set()
    for expr in exprs:
        tvm_ffi.structural_walk(expr, [(tirx.Var, lambda v: found.add(str(v.name)))])
    return found


def _serial_instances(stmt, indices) -> list:
    """`indices` (canonical), and when they use a short serial loop below the grid-stride one (an LSTM
    unit's gates, computed in turn by one warp), each of its iterations' indices, simplified: a reader of
    one of those elements reads what the same thread wrote."""
    short = _loop_counters(stmt)[1]
    used = [(var, extent) for var, extent in short if any(_uses(index, var) for index in indices)]
    if len(used) != 1:
        return [indices]
    var, extent = used[0]
    return [indices, *([_ANALYZER.simplify(substitute(index, {var.__chandle__(): tirx.IntImm(var.ty, value)}))
                        for index in indices] for value in range(extent))]


def _uses(expr, var) -> bool:
    found = []
    tvm_ffi.structural_walk(expr, [(tirx.Var, lambda v: found.append(v.same_as(var)))])
    return any(found)


_CANONICAL: dict[tuple[int, str, str], tirx.Var] = {}


def _bound(stmt, expr):
    """`expr` with the iteration variables of every block inside `stmt` replaced by their bindings (loop
    counters, which are distinct between statements; only the time loop's is shared)."""
    bindings = _accesses(stmt)[2]
    return tvm_ffi.structural_map(expr, [(tirx.Var, lambda var: bindings.get(var.__chandle__(), var))])


def _canonical(stmt, indices) -> list:
    """`indices` as functions of the loop counters of `stmt`, each counter renamed by its depth and kind
    (serial or the thread it is bound to), so that two stages' grid-stride and lane counters compare
    equal exactly when the same thread runs both iterations; block iteration variables replaced by their
    bindings (every block of the stage: a warp reduction and the epilogue after it, say)."""
    counters = _loop_counters(stmt)[0]
    return [tvm_ffi.structural_map(_bound(stmt, e), [(tirx.Var, lambda v: counters.get(v.__chandle__(), v))])
            for e in indices]


_COUNTERS: dict = {}  # statement handle -> (statement, counters, short serial loops), like _ACCESSES


def _loop_counters(stmt):
    """(loop variable handle -> canonical counter, [(canonical counter, extent)] of the serial loops of at
    most MAX_SERIAL iterations below the grid-stride loop) of a statement, walked once per analysis."""
    key = stmt.__chandle__()
    if key not in _COUNTERS:
        counters, short = {}, {}

        def visit(node, depth):
            if isinstance(node, tirx.For):
                kind = str(node.thread_binding.thread_tag) if node.thread_binding is not None else "serial"
                canonical = _CANONICAL.setdefault((depth, str(node.loop_var.ty), kind), tirx.Var(
                    f"loop{depth}_{kind.replace('.', '_')}", node.loop_var.ty))
                counters[node.loop_var.__chandle__()] = canonical
                if kind == "serial" and depth >= 1 and isinstance(node.extent, tirx.IntImm) \
                        and int(node.extent) <= MAX_SERIAL:
                    short[canonical.__chandle__()] = (canonical, int(node.extent))
                depth += 1
            for child in child_statements(node):
                visit(child, depth)

        visit(stmt, 0)
        _COUNTERS[key] = (stmt, counters, list(short.values()))  # the statement kept: its handle stays unique
    return _COUNTERS[key][1:]


def _forget() -> None:
    """Drop the per-statement caches once a function's analysis is done."""
    _ACCESSES.clear()
    _COUNTERS.clear()


def grid_syncs_per_call(func: tirx.PrimFunc) -> int:
    """Grid barriers one call executes (a barrier inside a time loop counts once per step)."""
    count = 0

    def visit(stmt, trips):
        nonlocal count
        if _is_sync(stmt):
            count += trips
            return
        if isinstance(stmt, tirx.For) and stmt.kind != tirx.ForKind.THREAD_BINDING:
            # a per-block extent (a tensor-core stage's tiles) holds no grid barrier: no block may skip one
            trips *= int(stmt.extent) if isinstance(stmt.extent, tirx.IntImm) else 1
        for child in child_statements(stmt):
            visit(child, trips)

    visit(func.body, 1)
    return count

