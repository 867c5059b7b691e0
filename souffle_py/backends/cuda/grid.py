"""Grid-synchronized kernels (paper section 6.4): the stages of a subprogram in one cooperative launch.

Every stage shares one launch nest, blocks x WARPS warps of WARP lanes (blockIdx.x, threadIdx.y; each
stage binds its own threadIdx.x loop of WARP lanes): each stage's output elements are spread over the
grid (element e of a stage goes to thread e % threads of block (e // threads) % blocks, in a grid-stride
loop over the rest), one thread per output element, its reductions serial. A reduction of at least
MIN_WARP_TERMS terms instead takes one warp per output: its lanes read adjacent terms (coalesced) and
combine their partial sums with warp shuffles (TVM's cross-thread reduction), no shared memory and no
__syncthreads. A GEMM stage instead takes
TILE x TILE output tiles per block (grid-stride over the tiles), MICRO x MICRO per thread, both operands
staged through shared memory by the block's threads together; its element-wise epilogue, when it is the
GEMM output's only reader, runs right after each thread's write-back. Between a stage and an earlier one
whose output it reads, every block waits at a grid-wide barrier (`tirx.cuda.grid_sync`, cooperative
groups) unless each thread reads only elements it wrote itself. A recurrence's time loop runs inside the
kernel with a barrier after each step, so an LSTM is one launch instead of one per step and stage.

All blocks of a cooperative launch must be resident at once, so `blocks` is at most SMs x the resident
blocks per SM that the kernel's threads, registers and shared memory allow (partition.py's occupancy
formula); the grid-stride loops make any smaller grid correct. The kernel requests a cooperative launch
(`tirx.kernel_launch_params` with `tirx.use_cooperative_launch`): without one, a grid barrier fails and
poisons the CUDA context (../shared/gpu/README.md).

Intermediates are kernel parameters that the runtime allocates once (a CUDA kernel cannot allocate
global memory); between stages they stay in L2.
"""

from __future__ import annotations

import logging
from math import prod
from typing import Sequence

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.sym import Analyzer

from souffle_py.backends.cuda.launches import child_statements
from souffle_py.backends.cuda.warps import (REDUCE, SPATIAL, WARP, guarded_write_backs, has_warp_reduction,
                                            gate_blocks, is_gate_cell, lane_reductions, shift_outputs,
                                            unlowered_warp_reductions, warp_reduced, warp_sync)
from souffle_py.codegen.recurrence import TIME_LOOP, Loop
from souffle_py.partition import HardwareSpec, max_active_blocks_per_sm
from souffle_py.schedule.default import block_kind
from te_passes.exprs import substitute
from te_passes.gate_projections import GATE_CELL

THREADS = 256             # threads per block of a grid kernel
WARPS = THREADS // WARP   # warps per block: threadIdx.y
MAX_SERIAL = 4            # a serial loop this short inside a stage's thread nest counts as that thread's
# A GEMM stage's tile: TILE x TILE outputs per block, each thread a MICRO x MICRO register tile, operands
# staged through shared memory K_TILE deep ((TILE / MICRO)^2 must be THREADS)
TILE, MICRO, K_TILE = 64, 4, 16
REGISTER_ESTIMATE = 64    # registers per thread assumed before ptxas reports the real figure
GRID_SYNC = "tirx.cuda.grid_sync"
LAUNCH_PARAMS = ["blockIdx.x", "threadIdx.x", "tirx.use_cooperative_launch"]
log = logging.getLogger(__name__)
_ANALYZER = Analyzer()


def grid_size(func: tirx.PrimFunc, spec: HardwareSpec, threads: int = THREADS,
              registers: int = REGISTER_ESTIMATE, shared_bytes: int = 0) -> tuple[int, int]:
    """(blocks, resident blocks per SM): enough blocks for every stage's threads at once (independent
    stages share a phase), at most one wave of the GPU."""
    per_sm = max_active_blocks_per_sm(spec, threads, registers, shared_bytes)
    sch = s_tir.Schedule(func)
    work = sum(_threads_wanted(sch.get(block)) for block in sch.get_child_blocks(sch.get_sblock("root")))
    return max(1, min(-(-work // threads), spec.sms * per_sm)), per_sm


def _threads_wanted(block) -> int:
    """Threads that compute a stage at once: one per output element, a warp per output of a reduction
    that warp_reduced() gives to warps."""
    outputs = prod(int(iv.dom.extent) for iv in block.iter_vars if int(iv.iter_type) == SPATIAL)
    return outputs * WARP if warp_reduced(block) else outputs


def grid_schedule(func: tirx.PrimFunc, loops: Sequence[Loop], blocks: int, threads: int = THREADS) -> tirx.PrimFunc:
    """`func` (a kernel with every stage output a parameter, time loops not yet merged) as one cooperative
    launch nest of `blocks` x `threads` with grid barriers between dependent stages: blockIdx.x and
    threadIdx.y (the warp) shared by every stage, then the stage's time loop, its grid-stride loop, its
    own threadIdx.x loop (the lane) and its reduction."""
    if threads != THREADS:
        raise ValueError(f"grid kernels have {THREADS} threads per block, not {threads}")
    recurrent = {name for loop in loops for name in loop.blocks}
    synced, rotation = _scheduled(func, loops, blocks)
    if any(rotation.warp_offsets.values()):  # warp stages move by their outputs, then the kernel again
        shifts = {name: elements for name, elements in rotation.warp_offsets.items() if elements}
        synced, _ = _scheduled(shift_outputs(func, shifts, recurrent), loops, blocks, rotation.offsets)
    unlowered = unlowered_warp_reductions(synced)
    if unlowered:  # its lanes would all add into one output: a race; the caller falls back to separate kernels
        raise ValueError(f"TVM does not lower the warp reduction of {', '.join(unlowered)} to shuffles")
    # a cooperative launch only where a barrier needs it: it limits the grid to one resident wave
    return synced.with_attr("tirx.kernel_launch_params", LAUNCH_PARAMS) if grid_syncs_per_call(synced) else synced


def _scheduled(func: tirx.PrimFunc, loops: Sequence[Loop], blocks: int, offsets: dict | None = None):
    """(the launch nest with barriers and spread phases, the phases' block offsets): `offsets`, when
    given, are those of a previous pass (warp stages then already moved by shift_outputs)."""
    sch = s_tir.Schedule(func)
    recurrent = {name for loop in loops for name in loop.blocks}
    block_loops, warp_loops, serial_reductions, tiled, warp_stages = [], [], [], [], []
    warp_gates: set[str] = set()
    for block in sch.get_child_blocks(sch.get_sblock("root")):
        stmt = sch.get(block)
        all_loops = list(sch.get_loops(block))
        if stmt.name_hint not in recurrent and tileable(sch, block):
            on_block, on_warp = _tile_gemm(sch, block, blocks)
            block_loops.append(on_block)
            warp_loops.append(on_warp)
            tiled.append(stmt.name_hint)
            continue
        time = all_loops[:1] if stmt.name_hint in recurrent else []
        inner = all_loops[len(time):]
        iter_vars = list(stmt.iter_vars)[len(time):]
        spatial = [l for l, iv in zip(inner, iter_vars) if int(iv.iter_type) == SPATIAL]
        reduce = [l for l, iv in zip(inner, iter_vars) if int(iv.iter_type) == REDUCE]
        if not spatial:
            spatial = [sch.add_unit_loop(inner[0] if inner else block)]
        gates = gate_blocks(stmt, recurrent) if warp_reduced(stmt) else 1
        in_turn = []
        if gates > 1:  # an LSTM step's gates: a unit's gates in one warp, one after another
            if int(sch.get(spatial[-1]).extent) != gates:  # [.., g * H + u], not yet [.., unit, g]
                spatial[-1:] = reversed(sch.split(spatial[-1], [gates, None]))
            in_turn = [spatial.pop()]
            sch.reorder(*spatial, *in_turn)  # the units next to the other spatial loops, the gate last
            warp_gates.add(stmt.name_hint)
        fused = sch.fuse(*spatial) if len(spatial) > 1 else spatial[0]
        if warp_reduced(stmt):  # a warp per output: lanes over the reduction, shuffles combine them
            outer, on_block, on_warp = sch.split(fused, [None, blocks, WARPS])
            terms = sch.fuse(*reduce) if len(reduce) > 1 else reduce[0]
            serial, lane = sch.split(terms, [None, WARP])
            sch.reorder(on_block, on_warp, *time, outer, *in_turn, lane, serial)
            if not time:
                warp_stages.append(stmt.name_hint)
        elif is_gate_cell(sch, block, warp_gates):  # in the warp that computed its unit's gates (lane 0)
            outer, on_block, on_warp = sch.split(fused, [None, blocks, WARPS])
            sch.reorder(on_block, on_warp, *time, outer)
            block_loops.append(on_block)
            warp_loops.append(on_warp)
            continue
        else:
            outer, on_block, on_warp, lane = sch.split(fused, [None, blocks, WARPS, WARP])
            sch.reorder(on_block, on_warp, *time, outer, lane, *reduce)
            if reduce:
                serial_reductions.append((stmt.name_hint, len(reduce)))
        sch.bind(lane, "threadIdx.x")
        block_loops.append(on_block)
        warp_loops.append(on_warp)
    on_block = sch.merge(*block_loops) if len(block_loops) > 1 else block_loops[0]
    on_warp = sch.merge(*warp_loops) if len(warp_loops) > 1 else warp_loops[0]
    for loop in loops:  # each recurrence's members share one time loop, inside the launch nest
        times = [sch.get_loops(sch.get_sblock(name))[2] for name in loop.blocks]
        merged = sch.merge(*times) if len(times) > 1 else times[0]
        sch.annotate(merged, TIME_LOOP, 1)
    sch.bind(on_block, "blockIdx.x")
    sch.bind(on_warp, "threadIdx.y")
    for name in tiled:  # after binding: shared-memory regions are relaxed over the block's threads
        _stage_operands(sch, sch.get_sblock(name))
    for name, n_reduce in serial_reductions:
        block = sch.get_sblock(name)
        block_loops_now = sch.get_loops(block)
        sch.decompose_reduction(block, block_loops_now[len(block_loops_now) - n_reduce])
    for name in warp_stages:
        sch = _with_warp_epilogue(sch, name, recurrent)
    rotation = _Rotation(blocks, offsets)
    return spread_phases(insert_grid_syncs(guarded_write_backs(sch.mod["main"])), rotation), rotation


GRID_BLOCKS, TIME_LOOPS = "souffle.grid_blocks", "souffle.time_loops"


def with_grid(func: tirx.PrimFunc, blocks: int, loops: Sequence[Loop]) -> tirx.PrimFunc:
    """Mark a kernel function for `grid_schedule` (the schedule function sees only the function)."""
    return func.with_attr(GRID_BLOCKS, blocks).with_attr(TIME_LOOPS, [list(loop.blocks) for loop in loops])


def grid_blocks(func: tirx.PrimFunc) -> int | None:
    """The grid of a function marked by `with_grid`, else None."""
    value = func.attrs.get(GRID_BLOCKS) if func.attrs is not None else None
    return None if value is None else int(value)


def schedule_marked(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`grid_schedule` of a function marked by `with_grid`."""
    loops = [Loop(tuple(str(n) for n in names), ()) for names in func.attrs[TIME_LOOPS]]
    return grid_schedule(func, loops, grid_blocks(func))


# --- GEMM stages: tiles through shared memory -------------------------------------------------------------
def tileable(sch, block, threads: int = THREADS) -> bool:
    """A GEMM-like block (one reduction, a product of two loads) whose rows, columns and reduction divide
    into the tile: it gets a shared-memory tiled schedule inside the grid kernel."""
    if (TILE // MICRO) ** 2 != threads or block_kind(sch, block) != "gemm":
        return False
    if len({region.source.name for region in sch.get(block).reads}) != 2:  # two operands, staged apart
        return False
    loops = sch.get_loops(block)
    *_, rows, cols, depth = (int(sch.get(l).extent) for l in loops)
    return len(loops) == len(sch.get(block).iter_vars) and rows % TILE == 0 and cols % TILE == 0 \
        and depth % K_TILE == 0


def _with_warp_epilogue(sch, name: str, recurrent):
    """`sch` with the only reader of warp reduction `name`, when element-wise, computed right after it in
    the warp's loop nest (its lane 0, TVM's cross-thread broadcast) instead of as a stage behind a grid
    barrier: attention's score scaling, a layer norm's square root (schedule propagation for warp
    stages). Tried on a copy: `sch` itself when the move does not apply."""
    consumers = sch.get_consumers(sch.get_sblock(name))
    if len(consumers) != 1:
        return sch
    consumer = sch.get(consumers[0])
    if consumer.name_hint in recurrent or any(int(iv.iter_type) == REDUCE for iv in consumer.iter_vars):
        return sch
    attempt = sch.copy()
    try:
        outer = attempt.get_loops(attempt.get_sblock(name))[2]  # block, warp, grid-stride loop
        attempt.reverse_compute_at(attempt.get_sblock(consumer.name_hint), outer)
    except Exception as exc:  # it reads other elements, or another stage's output computed later
        log.debug("epilogue %s stays a stage: %s", consumer.name_hint, str(exc).splitlines()[-1])
        return sch
    return attempt


def _tile_gemm(sch, block, blocks: int):
    """(block loop, warp loop) of a tiled GEMM stage: tiles (batch x rows x columns) over the grid in a
    grid-stride loop, each block's threads a (TILE / MICRO)^2 grid of MICRO x MICRO register tiles."""
    *batch, i, j, k = sch.get_loops(block)
    io, it, ir = sch.split(i, [None, TILE // MICRO, MICRO])
    jo, jt, jr = sch.split(j, [None, TILE // MICRO, MICRO])
    ko, ki = sch.split(k, [None, K_TILE])
    sch.reorder(*batch, io, jo, it, jt, ko, ki, ir, jr)
    tiles = sch.fuse(*batch, io, jo)
    outer, on_block = sch.split(tiles, [None, blocks])
    on_warp, lane = sch.split(sch.fuse(it, jt), [WARPS, WARP])
    sch.reorder(on_block, on_warp, outer, lane)
    sch.bind(lane, "threadIdx.x")
    return on_block, on_warp


def _stage_operands(sch, block) -> None:
    """Accumulate the register tile locally; stage both operands' K_TILE slices of the block's tile in
    shared memory, loaded by all the block's threads together (TVM adds the __syncthreads). An
    element-wise epilogue that is the GEMM output's only reader is computed by each thread right after it
    writes its results back (schedule propagation: no barrier between them)."""
    _, _, _, lane, ko, *_ = sch.get_loops(block)
    accumulator = sch.cache_write(block, 0, "local")
    sch.reverse_compute_at(accumulator, lane)
    _fuse_epilogue(sch, accumulator, lane)
    for operand in (0, 1):
        staged = sch.cache_read(block, operand, "shared", consumer_blocks=[block])
        sch.compute_at(staged, ko)
        fused = sch.fuse(*sch.get_loops(staged)[-2:])
        _, on_warp, on_lane = sch.split(fused, [None, WARPS, WARP])
        sch.bind(on_warp, "threadIdx.y")
        sch.bind(on_lane, "threadIdx.x")
    sch.decompose_reduction(block, sch.get_loops(block)[4])


def _fuse_epilogue(sch, write_back, thread_loop) -> None:
    """Compute the GEMM output's only reader, when element-wise, right after the tile's write-back: each
    thread then reads back its own 4 x 4 results (no barrier, the values still in L1)."""
    consumers = sch.get_consumers(write_back)
    if len(consumers) != 1 or any(int(iv.iter_type) == REDUCE for iv in sch.get(consumers[0]).iter_vars):
        return
    try:
        sch.reverse_compute_at(consumers[0], thread_loop)
    except Exception as exc:  # e.g. it reads the output transposed: a stage of its own, behind a barrier
        log.debug("epilogue %s stays a stage: %s", sch.get(consumers[0]).name_hint, str(exc).splitlines()[-1])


# --- grid barriers ------------------------------------------------------------------------------------------
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
        _ACCESSES.clear()


def spread_phases(func: tirx.PrimFunc, rotation: "_Rotation | None" = None) -> tirx.PrimFunc:
    """Spread the stages of each phase (the code between two grid barriers) over the grid: a stage starts
    at the block after the last one the previous stages of its phase use, so independent small stages
    (the wavefront's per-layer GEMVs: 19 of 4 blocks each) run on different SMs at once instead of all on
    blocks 0-3. A stage's blocks are rotated, a bijection, so every element is still computed once;
    stages linked by reads inside a phase share one rotation (the barrier analysis proved those reads
    same-thread, and they must stay so). Warp reductions are not rotated (a rotated block index is not
    affine, and TVM would not lower their shuffles): `rotation` records their offsets, for
    warps.shift_outputs to move their outputs instead, before the kernel is scheduled again with the
    same offsets."""

    def visit(loop):
        warps = _warp_loop(loop)
        if warps is None:
            return loop
        rotate = rotation or _Rotation(int(loop.extent))
        rotate.block_var = loop.loop_var
        return _with_body(loop, _with_body(warps, _seq(rotate.phases(_statements(warps.body)))))

    try:
        return tvm_ffi.structural_map(func, [(tirx.For, visit)])
    finally:
        _ACCESSES.clear()


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


class _Rotation:
    """Block offsets of the stages of each phase (spread_phases): `offsets` by stage (its first block's
    name; given: those of a previous pass), `warp_offsets` (in output elements) by block of the groups
    with a warp reduction, which move by their outputs instead of being rotated."""

    def __init__(self, blocks: int, offsets: dict | None = None):
        self.block_var, self.blocks, self.given = None, blocks, offsets is not None
        self.offsets: dict[str, int] = dict(offsets or {})
        self.warp_offsets: dict[str, int] = {}

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
                    self.warp_offsets.update({name: offsets[root(i)] * per_block for name in _block_names(stmt)})
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
        if name in written and not _same_thread(written[name], indices, producer, consumer) \
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
        stores, loads, bindings = {}, [], {}
        tvm_ffi.structural_walk(stmt, [
            (tirx.BufferStore, lambda s: stores.setdefault(s.buffer.name, []).append(s.indices)),
            (tvm.ir.expr.TensorLoad, lambda l: loads.append((l.source.name, l.indices))),
            (s_tir.stmt.SBlockRealize, lambda r: bindings.update(
                {iv.var.__chandle__(): value for iv, value in zip(r.block.iter_vars, r.iter_values)}))])
        _ACCESSES[key] = (stmt, stores, loads, bindings)  # the statement kept alive: its handle stays unique
    return _ACCESSES[key][1:]


def _stores(stmt) -> dict:
    return _accesses(stmt)[0]


def _loads(stmt) -> list:
    return _accesses(stmt)[1]


def _same_thread(stores, load_indices, producer, consumer) -> bool:
    """Each thread reads only elements it wrote itself: the producer writes the buffer at exactly the
    indices the consumer reads, as functions of the same block, thread and grid-stride loop counters."""
    if _is_time_loop(producer) or _is_time_loop(consumer) or not stores:
        return False
    canonical_load = _canonical(consumer, load_indices)
    simplified_load = [_ANALYZER.simplify(index) for index in canonical_load]
    return all(any(tvm_ffi.structural_equal(instance, load)
                   for instance in _serial_instances(producer, _canonical(producer, s))
                   for load in (canonical_load, simplified_load)) for s in stores)


def _serial_instances(stmt, indices) -> list:
    """`indices` (canonical), and when they use a short serial loop below the grid-stride one (an LSTM
    unit's gates, computed in turn by one warp), each of its iterations' indices, simplified: a reader of
    one of those elements reads what the same thread wrote."""
    serial = {}

    def visit(node, depth):
        if isinstance(node, tirx.For):
            if node.thread_binding is None and depth >= 1 and int(node.extent) <= MAX_SERIAL:
                key = (depth, str(node.loop_var.ty), "serial")
                if key in _CANONICAL:
                    serial[_CANONICAL[key].__chandle__()] = (_CANONICAL[key], int(node.extent))
            depth += 1
        for child in child_statements(node):
            visit(child, depth)

    visit(stmt, 0)
    used = [(var, extent) for var, extent in serial.values()
            if any(_uses(index, var) for index in indices)]
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
    counters = {}

    def visit(node, depth):
        if isinstance(node, tirx.For):
            kind = str(node.thread_binding.thread_tag) if node.thread_binding is not None else "serial"
            key = (depth, str(node.loop_var.ty), kind)
            counters[node.loop_var.__chandle__()] = _CANONICAL.setdefault(
                key, tirx.Var(f"loop{depth}_{kind.replace('.', '_')}", node.loop_var.ty))
            depth += 1
        for child in child_statements(node):
            visit(child, depth)

    visit(stmt, 0)
    return [tvm_ffi.structural_map(_bound(stmt, e), [(tirx.Var, lambda v: counters.get(v.__chandle__(), v))])
            for e in indices]


def grid_syncs_per_call(func: tirx.PrimFunc) -> int:
    """Grid barriers one call executes (a barrier inside a time loop counts once per step)."""
    count = 0

    def visit(stmt, trips):
        nonlocal count
        if _is_sync(stmt):
            count += trips
            return
        if isinstance(stmt, tirx.For) and stmt.kind != tirx.ForKind.THREAD_BINDING:
            trips *= int(stmt.extent)
        for child in child_statements(stmt):
            visit(child, trips)

    visit(func.body, 1)
    return count

