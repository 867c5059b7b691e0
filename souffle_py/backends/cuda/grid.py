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
groups) unless each thread reads only elements it wrote itself (barriers.py). A recurrence's time loop runs inside the
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
from typing import Mapping, Sequence

import tvm_ffi
from tvm import s_tir, tirx

from souffle_py.backends.cuda.barriers import Rotation, grid_syncs_per_call, insert_grid_syncs, spread_phases
from souffle_py.backends.cuda.nest import K_TILE, MICRO, THREADS, TILE, WARP, WARPS
from souffle_py.backends.cuda.transplant import (StageSchedule, TransplantError, bind_stage, check_shared_loads,
                                                 decompose_marked, replay_stage)
from souffle_py.backends.cuda.wmma_stages import clauses as _clauses, per_block_tiles, tensorize_marked
from souffle_py.backends.cuda.warps import (REDUCE, SPATIAL, gate_blocks, guarded_write_backs, is_gate_cell,
                                            lane_reductions, shift_outputs, unlowered_warp_reductions, warp_reduced)
from souffle_py.codegen.recurrence import TIME_LOOP, Loop
from souffle_py.failures import rule_failed
from souffle_py.partition import HardwareSpec, max_active_blocks_per_sm
from souffle_py.schedule.blocks import block_kind

REGISTER_ESTIMATE = 64    # registers per thread assumed before ptxas reports the real figure
LAUNCH_PARAMS = ["blockIdx.x", "threadIdx.x", "tirx.use_cooperative_launch"]
log = logging.getLogger(__name__)


def grid_size(func: tirx.PrimFunc, spec: HardwareSpec, threads: int = THREADS,
              registers: int = REGISTER_ESTIMATE, shared_bytes: int = 0, per_sm: int | None = None
              ) -> tuple[int, int]:
    """(blocks, resident blocks per SM): enough blocks for every stage's threads at once (independent
    stages share a phase), at most one wave of the GPU; `per_sm` (the occupancy of the kernel's stages,
    occupancy.py) replaces the one of `registers` and `shared_bytes`."""
    per_sm = max_active_blocks_per_sm(spec, threads, registers, shared_bytes) if per_sm is None else per_sm
    sch = s_tir.Schedule(func)
    work = sum(_threads_wanted(sch.get(block)) for block in sch.get_child_blocks(sch.get_sblock("root")))
    return max(1, min(-(-work // threads), spec.sms * per_sm)), per_sm


def _threads_wanted(block) -> int:
    """Threads that compute a stage at once: one per output element, a warp per output of a reduction
    that warp_reduced() gives to warps."""
    outputs = prod(int(iv.dom.extent) for iv in block.iter_vars if int(iv.iter_type) == SPATIAL)
    return outputs * WARP if warp_reduced(block) else outputs


def grid_schedule(func: tirx.PrimFunc, loops: Sequence[Loop], blocks: int, threads: int = THREADS,
                  stages: Mapping[str, Sequence[StageSchedule]] | None = None) -> tirx.PrimFunc:
    """`func` (a kernel with every stage output a parameter, time loops not yet merged) as one cooperative
    launch nest of `blocks` x `threads` with grid barriers between dependent stages: blockIdx.x and
    threadIdx.y (the warp) shared by every stage, then the stage's time loop, its grid-stride loop, its
    own threadIdx.x loop (the lane) and its reduction. `stages`: candidate schedules of GEMM stages
    (transplant.py), best first; a GEMM stage none of whose candidates transplants gets grid.py's tile."""
    if threads != THREADS:
        raise ValueError(f"grid kernels have {THREADS} threads per block, not {threads}")
    synced, rotation = _scheduled(func, loops, blocks, stages=stages)
    shifts = {name: elements for name, elements in rotation.shifts.items() if elements}
    if shifts:  # groups with a warp reduction move by their outputs, then the kernel is scheduled again
        recurrent = {name for loop in loops for name in loop.blocks}
        synced, _ = _scheduled(shift_outputs(func, shifts, recurrent), loops, blocks, rotation.offsets, stages)
    unlowered = unlowered_warp_reductions(synced)
    if unlowered:  # its lanes would all add into one output: a race; the caller falls back to separate kernels
        raise ValueError(f"TVM does not lower the warp reduction of {', '.join(unlowered)} to shuffles")
    # a cooperative launch only where a barrier needs it: it limits the grid to one resident wave
    return synced.with_attr("tirx.kernel_launch_params", LAUNCH_PARAMS) if grid_syncs_per_call(synced) else synced


def _scheduled(func: tirx.PrimFunc, loops: Sequence[Loop], blocks: int, offsets: dict | None = None,
               stages: Mapping[str, Sequence[StageSchedule]] | None = None):
    """(the launch nest with barriers and spread phases, the phases' block offsets): `offsets`, when
    given, are those of a previous pass (warp stages then already moved by shift_outputs)."""
    recurrent = {name for loop in loops for name in loop.blocks}
    local = set(local_stages(func))  # computed in the loads of the GEMM reading them, not as stages
    sch, nests, sources = _transplanted(s_tir.Schedule(func), stages or {}, blocks)
    block_loops, warp_loops, serial_reductions, tiled, warp_stages = [], [], [], [], []
    warp_gates: set[str] = set()
    joined: list = []   # the transplanted nests already in the launch nest
    for block in sch.get_child_blocks(sch.get_sblock("root")):
        stmt = sch.get(block)
        if stmt.name_hint in nests:  # a transplanted stage's block: its nest joins the launch nest once
            nest = nests.pop(stmt.name_hint)
            if nest not in joined:
                joined.append(nest)
                block_loops.append(nest[0])
                warp_loops.append(nest[1])
            continue
        if stmt.name_hint in local:
            continue
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
        warp = warp_reduced(stmt)
        gates = gate_blocks(stmt, recurrent) if warp else 1
        in_turn = []
        if gates > 1:  # an LSTM step's gates: a unit's gates in one warp, one after another
            if int(sch.get(spatial[-1]).extent) != gates:  # [.., g * H + u], not yet [.., unit, g]
                spatial[-1:] = reversed(sch.split(spatial[-1], [gates, None]))
            in_turn = [spatial.pop()]
            sch.reorder(*spatial, *in_turn)  # the units next to the other spatial loops, the gate last
            warp_gates.add(stmt.name_hint)
        fused = sch.fuse(*spatial) if len(spatial) > 1 else spatial[0]
        if warp:  # a warp per output: lanes over the reduction, shuffles combine them
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
    check_shared_loads(sch)  # the transplanted stages' loads too
    decompose_marked(sch)
    for name, n_reduce in serial_reductions:
        block = sch.get_sblock(name)
        block_loops_now = sch.get_loops(block)
        sch.decompose_reduction(block, block_loops_now[len(block_loops_now) - n_reduce])
    for name in warp_stages:
        sch = _with_warp_epilogue(sch, name, recurrent)
    sch = s_tir.Schedule(per_block_tiles(sch.mod["main"], counts=False))
    tensorize_marked(sch)  # last: TVM cannot copy a schedule state with tensorized blocks in it
    left = local_stages(sch.mod["main"])
    if left:  # a kernel cannot allocate global memory: the caller builds the kernel without local stages
        raise ValueError(f"local stages {', '.join(left)} are not computed in a GEMM's loads")
    rotation = Rotation(blocks, offsets)
    guarded = guarded_tiles(per_block_tiles(sch.mod["main"], counts=True))
    synced = spread_phases(insert_grid_syncs(guarded_write_backs(guarded)), rotation)
    return (synced.with_attr(STAGE_SCHEDULES, sources) if sources else synced), rotation


STAGE_SCHEDULES = "souffle.stage_schedules"   # function attribute: stage -> where its schedule came from


def stage_sources(func: tirx.PrimFunc) -> tuple:
    """((stage index, where its schedule came from), ...) of a grid kernel's transplanted stages."""
    sources = func.attrs.get(STAGE_SCHEDULES) if func.attrs is not None else None
    return tuple(sorted((int(str(name)[1:]), str(source)) for name, source in (sources or {}).items()))


def _transplanted(sch, stages: Mapping[str, Sequence[StageSchedule]], blocks: int):
    """(`sch` with the first candidate of each stage that transplants, {block name: (block loop, warp
    loop) of the transplanted nest it is in}, {stage: source}). Every stage replays before any is rebound
    (transplant.replay_stage says why); a candidate's rebinding is tried on a copy first. The GEMM
    output's element-wise epilogue then joins each thread's tile (_fuse_epilogue), and its prologues its
    shared-memory loads (inline_prologues)."""
    replayed, sources = [], {}
    for name, candidates in stages.items():
        for candidate in candidates:
            attempt = sch.copy()
            try:
                stage = replay_stage(attempt, name, candidate)
                bind_stage(attempt.copy(), stage, blocks)
            except TransplantError as exc:  # bindings that do not map onto the kernel's nest: by design
                log.info("stage %s: its %s schedule does not transplant (%s)", name, candidate.source, exc)
                continue
            except Exception as exc:  # noqa: BLE001  (a record of another TVM version, a schedule TVM refuses)
                rule_failed("stage schedule transplant", f"stage {name}", exc,
                            fallback="its next candidate schedule (else the launch nest's)")
                continue
            sch = attempt
            replayed.append(stage)
            sources[name] = candidate.source
            break
    nests = {}
    for stage in replayed:
        on_block, on_warp, lane, writer = bind_stage(sch, stage, blocks)
        readers = tuple(sch.get(b).name_hint for b in sch.get_consumers(writer))
        if lane is not None and readers == stage.readers:  # (a tensor-core stage's epilogue stays a stage)
            _fuse_epilogue(sch, writer, lane)
        inline_prologues(sch, on_block)
        names = []
        tvm_ffi.structural_walk(sch.get(on_block), [(s_tir.stmt.SBlockRealize,
                                                     lambda r: names.append(r.block.name_hint))])
        nests.update(dict.fromkeys(names, (on_block, on_warp)))
    return sch, nests, sources


GRID_BLOCKS, TIME_LOOPS = "souffle.grid_blocks", "souffle.time_loops"


def with_grid(func: tirx.PrimFunc, blocks: int, loops: Sequence[Loop]) -> tirx.PrimFunc:
    """Mark a kernel function for `grid_schedule` (the schedule function sees only the function)."""
    return func.with_attr(GRID_BLOCKS, blocks).with_attr(TIME_LOOPS, [list(loop.blocks) for loop in loops])


def grid_blocks(func: tirx.PrimFunc) -> int | None:
    """The grid of a function marked by `with_grid`, else None."""
    value = func.attrs.get(GRID_BLOCKS) if func.attrs is not None else None
    return None if value is None else int(value)


def schedule_marked(func: tirx.PrimFunc, stages: Mapping[str, Sequence[StageSchedule]] | None = None
                    ) -> tirx.PrimFunc:
    """`grid_schedule` of a function marked by `with_grid`."""
    loops = [Loop(tuple(str(n) for n in names), ()) for names in func.attrs[TIME_LOOPS]]
    return grid_schedule(func, loops, grid_blocks(func), stages=stages)


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
    if consumer.name_hint in recurrent or any(int(iv.iter_type) == REDUCE for iv in consumer.iter_vars) \
            or any(str(w.source.scope()) != "global" for w in consumer.writes):
        # (a GEMM's shared-memory load, in which its prologue reading the reduction is computed: T5's
        # softmax sum at the start of a kernel, its normalization computed in P.V's loads, took the
        # load into the warp's loop nest, and the reduction no longer lowered to shuffles)
        return sch
    attempt = sch.copy()
    try:
        outer = attempt.get_loops(attempt.get_sblock(name))[2]  # block, warp, grid-stride loop
        attempt.reverse_compute_at(attempt.get_sblock(consumer.name_hint), outer)
    except Exception as exc:  # it reads other elements, or another stage's output computed later
        log.debug("epilogue %s stays a stage: %s", consumer.name_hint, str(exc).splitlines()[-1])
        return sch
    return attempt


def guarded_tiles(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """Every block of a tiled GEMM stage guarded by its tile's existence. Splitting a stage's tiles over
    the grid guards the blocks under the split (`tile < tiles`), but a block placed there afterwards
    (reverse_compute_at: the accumulator's write-back, an epilogue) is guarded only where its indices
    would leave the output: a stage of one tile would have every block of the grid write back
    accumulators it never computed. The clauses of its blocks' predicates over the block and
    grid-stride loops alone are the tile's existence; each block of the stage gets them all. A warp
    reduction's epilogue (`_with_warp_epilogue`) likewise gets its reduction's clauses over the block,
    warp and grid-stride loops: an epilogue of one output element (a norm, [1, 1]) had none, and every
    warp of the grid wrote it from a reduction only warp 0 had computed (sbert's wrong output on an H100)."""

    def visit(loop):
        warps = loop.body if loop.thread_binding is not None and str(loop.thread_binding.thread_tag) == "blockIdx.x" \
            else None
        if not (isinstance(warps, tirx.For) and warps.thread_binding is not None):
            return loop
        stages = list(warps.body.seq) if isinstance(warps.body, tirx.SeqStmt) else [warps.body]
        guarded = [_guard_tile(stage, loop.loop_var, warps.loop_var) for stage in stages]
        body = guarded[0] if len(guarded) == 1 else tirx.SeqStmt(guarded)
        return tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind,
                        tirx.For(warps.loop_var, warps.min, warps.extent, warps.kind, body, warps.thread_binding,
                                 warps.annotations), loop.thread_binding, loop.annotations)

    return tvm_ffi.structural_map(func, [(tirx.For, visit)])


def _guard_tile(stage, block_var, warp_var):
    """`stage` (a statement under the warp loop) with its tile guard on every block, if it is tiled, or
    its warp reduction's output guard on every block, if it reduces across lanes."""
    shared = []
    tvm_ffi.structural_walk(stage, [(tirx.BufferStore, lambda st: shared.append(str(st.buffer.scope()) == "shared"))])
    if not isinstance(stage, tirx.For) or TIME_LOOP in stage.annotations or not (any(shared) or lane_reductions(stage)):
        return stage
    outer = {block_var.__chandle__(), stage.loop_var.__chandle__()}
    if not any(shared):  # a warp stage: its outputs are the block's warps'
        outer.add(warp_var.__chandle__())
    clauses = []

    def collect(realize):
        for clause in _clauses(realize.predicate):
            used = []
            tvm_ffi.structural_walk(clause, [(tirx.Var, lambda v: used.append(v.__chandle__()))])
            if used and set(used) <= outer and not any(tvm_ffi.structural_equal(clause, c) for c in clauses):
                clauses.append(clause)

    tvm_ffi.structural_walk(stage, [(s_tir.stmt.SBlockRealize, collect)])

    def guard(realize):
        own = _clauses(realize.predicate)
        missing = [c for c in clauses if not any(tvm_ffi.structural_equal(c, o) for o in own)]
        if not missing:
            return realize
        if not any(shared) and _uses_any(realize.iter_values, (block_var, warp_var)):
            return realize  # TVM bounds a warp epilogue's indices (a predicate here would stop its broadcast)
        predicate = realize.predicate
        for clause in missing:
            predicate = clause if isinstance(predicate, tirx.IntImm) and int(predicate) else tirx.And(predicate, clause)
        return s_tir.stmt.SBlockRealize(realize.iter_values, predicate, realize.block)

    return tvm_ffi.structural_map(stage, [(s_tir.stmt.SBlockRealize, guard)]) if clauses else stage


def _uses_any(exprs, variables) -> bool:
    found = []
    for expr in exprs:
        tvm_ffi.structural_walk(expr, [(tirx.Var, lambda v: found.append(any(v.same_as(w) for w in variables)))])
    return any(found)


def inline_prologues(sch, nest) -> None:
    """Compute each local stage (an output the kernel keeps inside, merge.py's `local`: an element-wise
    stage read only by a GEMM) in the shared-memory loads of the GEMM's nest `nest` (a loop or block
    random variable) that read it: once per tile load, where it would be a stage of its own behind a grid
    barrier (attention's softmax normalization read by P.V). Schedule propagation of prologues. The loads
    are found as blocks, not by name: two GEMMs staging one weight (ALBERT's shared layers) made two
    blocks `in8_shared`."""
    params = {param.__chandle__() for param in sch.mod["main"].params}
    found = [nest] if isinstance(sch.get(nest), s_tir.stmt.SBlock) else sch.get_child_blocks(nest)
    loads = [b for b in found if any(str(w.source.scope()) == "shared" for w in sch.get(b).writes)]
    for load in loads:
        for producer in sch.get_producers(load):
            writes = sch.get(producer).writes
            if all(w.source.__chandle__() not in params and str(w.source.scope()) == "global" for w in writes):
                sch.compute_inline(producer)


def local_stages(func: tirx.PrimFunc) -> list[str]:
    """The blocks writing a buffer that is not a parameter: local stages, which must be inlined."""
    params = {param.__chandle__() for param in func.params}
    local = []
    tvm_ffi.structural_walk(func.body, [(s_tir.stmt.SBlock, lambda b: local.append(b.name_hint) if b.writes and all(
        w.source.__chandle__() not in params and str(w.source.scope()) == "global" for w in b.writes)
        else None)])
    return local


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
        inline_prologues(sch, staged)
        fused = sch.fuse(*sch.get_loops(staged)[-2:])
        _, on_warp, on_lane = sch.split(fused, [None, WARPS, WARP])
        sch.bind(on_warp, "threadIdx.y")
        sch.bind(on_lane, "threadIdx.x")
    sch.decompose_reduction(block, sch.get_loops(block)[4])


def _fuse_epilogue(sch, write_back, thread_loop) -> None:
    """Compute the GEMM output's only reader, when element-wise, right after the tile's write-back: each
    thread then reads back its own 4 x 4 results (no barrier, the values still in L1)."""
    consumers = sch.get_consumers(write_back)
    if len(consumers) != 1 or any(int(iv.iter_type) == REDUCE for iv in sch.get(consumers[0]).iter_vars) \
            or not _reads_at_its_own_point(sch.get(consumers[0]), sch.get(write_back).writes[0].source):
        return
    try:
        sch.reverse_compute_at(consumers[0], thread_loop)
    except Exception as exc:  # e.g. it reads the output transposed: a stage of its own, behind a barrier
        log.debug("epilogue %s stays a stage: %s", sch.get(consumers[0]).name_hint, str(exc).splitlines()[-1])


def _reads_at_its_own_point(consumer, buffer) -> bool:
    """Whether block `consumer` reads `buffer` only at its own iteration point (each index one of its
    iteration variables or a constant, no variable twice): then computing it where a thread wrote its
    part of `buffer` computes all of it. A padded copy reads at an offset, and its border reads nothing:
    computed so, the border was never written (a ResNeXt block's padded input, left as garbage)."""
    own = {iv.var.__chandle__() for iv in consumer.iter_vars}
    for region in consumer.reads:
        if not region.source.same_as(buffer):
            continue
        used = []
        for r in region.region:
            if isinstance(r.min, tirx.Var) and r.min.__chandle__() in own:
                used.append(r.min.__chandle__())
            elif not isinstance(r.min, tirx.IntImm):
                return False
        if len(set(used)) != len(used):
            return False
    return True
