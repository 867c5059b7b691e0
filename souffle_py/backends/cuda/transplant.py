"""Stage schedules transplanted into a grid kernel's launch nest (paper section 6.4).

A GEMM stage of a grid-synchronized kernel keeps the schedule it gets alone: the best MetaSchedule record
of the stage as a function of its own (schedule/stages.py cuts it out under canonical names, so identical
stages across layers share one record), else, for float16 / bfloat16 operands, the wmma schedule
(tensor_cores.GridTensorCores: the kernel's 8 warps on 64 x 64 tiles), else dlight's GEMM rule with its
CUDA configuration and the kernel's thread block (16 x 16 = THREADS threads). Every stage's trace is
replayed on the stage inside the kernel with its launch bindings (`replay_stage`), its reduction's init
split and its tensorization deferred (marks on the loops); then the bound loops become marks and are
bound into the kernel's shared nest (`bind_stage`):

- the stage's block loops, fused, become a grid-stride loop around the kernel's blockIdx.x (a stage with
  more blocks than the kernel takes turns; one with fewer leaves blocks idle);
- its thread loops, fused (a linear thread index), become the kernel's warp (threadIdx.y) and lane
  (threadIdx.x) loops, with a guard where the stage has fewer threads than the kernel; a tensor-core
  stage's thread loops are its warps alone, which stay the kernel's warps (their lanes work together in
  each wmma intrinsic);
- its cooperative shared-memory loads, bound to the same threads, are rebound the same way.

Everything else (tiles, vthreads, shared and local caches, fragments, vectorized loads, unrolling) stays
as the schedule made it. The grid barriers around the stage follow from its element accesses
(barriers.py); what a tensor-core stage defers to the end is wmma_stages.py's.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Sequence

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir import dlight as dl

from souffle_py.backends.cuda.launches import thread_aliased_blocks
from souffle_py.backends.cuda.nest import K_TILE, THREADS, TILE, WARP, WARPS
from souffle_py.backends.cuda.tensor_cores import GridTensorCores, TensorCoreRefusal, reduced_dtype
from souffle_py.backends.cuda.wmma_stages import TENSORIZE, TILES, tensorized_init
from souffle_py.errors import SouffleError
from souffle_py.schedule import tuning
from souffle_py.schedule.stages import STAGE, compute_stages, replay_json
from souffle_py.structural import StructuralMap

BOUND = "souffle.bound"    # loop annotation: the thread the stage's own schedule bound it to
DECOMPOSE = "souffle.decompose"   # loop annotation: where the schedule split off the reduction's init
TENSOR_CORES = "tensor cores (wmma)"   # the source of a stage scheduled by GridTensorCores
LAUNCH_TAGS = ("blockIdx.", "threadIdx.", "vthread")  # bindings replayed as marks (vthreads rebound as they were)
log = logging.getLogger(__name__)


class TransplantError(SouffleError):
    """A stage schedule whose launch bindings do not map onto the grid kernel's nest."""


class GridMatmul(dl.gpu.Matmul):
    """dlight's GEMM rule with its CUDA configuration, its thread block that of a grid kernel."""

    def get_configs(self, target):
        return dataclasses.replace(super().get_configs(target), block_size_x=16, block_size_y=THREADS // 16)


@dataclasses.dataclass(frozen=True)
class StageSchedule:
    """A candidate schedule of one stage: where it came from, and its trace on the stage alone."""

    source: str
    trace: s_tir.schedule.Trace


def stage_target(target: tvm.target.Target) -> tvm.target.Target:
    """`target` with a grid kernel's thread block as its limit: what a stage is scheduled and tuned for
    (MetaSchedule then samples no thread block larger than the kernel's), and the key of its records."""
    attrs = {key: value for key, value in target.export().items() if key != "host"}
    return tvm.target.Target({**attrs, "max_num_threads": THREADS, "max_threads_per_block": THREADS},
                             host=target.host)


def selected_stages(func: tirx.PrimFunc, select: Callable) -> list:
    """The GEMM stages of `func` (schedule/stages.py) that `select(sch, block)` accepts."""
    sch = s_tir.Schedule(func)
    return [stage for stage in compute_stages(func) if select(sch, sch.get_sblock(stage.block))]


def stage_tasks(funcs: Sequence[tirx.PrimFunc], selector: Callable) -> dict[str, tirx.PrimFunc]:
    """Every stage of the grid kernels `funcs` that `selector(func)` selects, by "kernel.block", as tuning
    tasks (tuning.tune groups equal ones: BERT's layers give one task per distinct GEMM)."""
    return {f"{i}.{stage.block}": stage.func for i, func in enumerate(funcs)
            for stage in selected_stages(func, selector(func))}


_DLIGHT_TRACES = StructuralMap()  # stage function (+ target, rule config) -> its trace or None


def dlight_stage_trace(stage_func: tirx.PrimFunc, target) -> s_tir.schedule.Trace | None:
    """The trace of dlight's GEMM rule (GridMatmul) on a stage alone, None where it does not apply;
    made once per distinct stage (BERT-base's 60 GEMM stages are 5 distinct ones)."""
    target = stage_target(target)
    rule = GridMatmul()

    def make():
        with target:
            try:
                scheduled = rule.apply(stage_func, target, False)
            except Exception as exc:  # a rule that does not fit may raise instead of returning None
                log.debug("dlight's GEMM rule does not schedule the stage: %s", exc)
                return None
        return None if scheduled is None else scheduled.trace

    return _DLIGHT_TRACES.setdefault(stage_func, make, extra=(str(target), str(rule.get_configs(target))))


_TENSOR_CORE_TRACES = StructuralMap()  # stage function (+ target) -> its GridTensorCores trace or None


def tensor_core_stage_trace(stage_func: tirx.PrimFunc, target) -> tuple[s_tir.schedule.Trace | None, str]:
    """(the trace of the wmma rule, tensor_cores.GridTensorCores, on a stage alone, "") or (None, why a
    float16 / bfloat16 stage stays on CUDA cores; "" for a float32 one)."""
    target = stage_target(target)

    def make():
        with target:
            try:
                return GridTensorCores().schedule(stage_func, target).trace, ""
            except TensorCoreRefusal as refusal:
                return None, str(refusal) if refusal.reduced else ""

    return _TENSOR_CORE_TRACES.setdefault(stage_func, make, extra=(str(target),))


def dlight_baseline(target) -> Callable[[s_tir.Schedule], None]:
    """Tuning's `baseline` for stage tasks: the schedule a stage gets untuned, recorded on `sch`."""
    def apply(sch: s_tir.Schedule) -> None:
        trace = dlight_stage_trace(sch.mod["main"], target)
        if trace is None:
            raise TransplantError("dlight's GEMM rule does not schedule this stage")
        trace.apply_to_schedule(sch, remove_postproc=False)

    return apply


def stage_schedules(func: tirx.PrimFunc, target, select: Callable, database=None) -> dict[str, list[StageSchedule]]:
    """For each GEMM stage of `func` that `select(sch, block)` accepts, its candidate schedules, best
    first: the database's records of the stage alone (tuned on a GPU for stage_target), then the wmma
    rule (float16 / bfloat16 operands on tensor cores), then dlight's GEMM rule (CUDA cores)."""
    found: dict[str, list[StageSchedule]] = {}
    _log_untiled_reduced_stages(func, select)
    for stage in selected_stages(func, select):
        candidates = [StageSchedule("tuned record", trace)
                      for trace in (tuning.best_traces(database, stage.func) if database is not None else [])]
        trace, refusal = tensor_core_stage_trace(stage.func, target)
        if trace is not None:
            candidates.append(StageSchedule(TENSOR_CORES, trace))
        elif refusal:
            log.info("stage %s stays on CUDA cores: %s", stage.block, refusal)
        trace = dlight_stage_trace(stage.func, target)
        if trace is not None:
            candidates.append(StageSchedule("dlight Matmul", trace))
        if candidates:
            found[stage.block] = candidates
    return found


@dataclasses.dataclass(frozen=True)
class Replayed:
    """A stage whose schedule replayed inside the kernel, its launch loops not yet rebound: its block, the
    blocks of its nest (by name), the buffer it outputs and the blocks that read it then (by name: a later
    stage's replay adds its own loads of it, which are no epilogue of this one)."""

    block: str
    nest: tuple[str, ...]
    output: str
    readers: tuple[str, ...]


def replay_stage(sch: s_tir.Schedule, block: str, schedule: StageSchedule) -> Replayed:
    """Replay `schedule` on stage `block` of the grid kernel in `sch`, its launch bindings as they were on
    the stage alone (bind_stage rebinds them). Every stage of a kernel replays before any is rebound: a
    rebound stage's tiles are predicated (past the last tile its indices leave the buffers), which TVM's
    region-cover check cannot prove, and a replay that rebuilds the kernel's scope (blockize: a
    tensor-core schedule) would find the kernel no stage pipeline and refuse every compute-at after.
    Raises TransplantError (`sch` then partly scheduled: use a copy)."""
    output = sch.get(sch.get_sblock(block)).writes[0].source.name
    own = sch.get_sref(sch.get_sblock(block))
    others = [sch.get_sref(b) for b in sch.get_child_blocks(sch.get_sblock("root"))
              if not sch.get_sref(b).same_as(own)]
    replay_json(sch, block, _unbound(schedule.trace))
    made = [b for b in sch.get_child_blocks(sch.get_sblock("root"))  # the stage's blocks (srefs: not names,
            if not any(sch.get_sref(b).same_as(other) for other in others)  # which another stage's may share)
            and any(sch.get(loop).thread_binding is not None for loop in sch.get_loops(b))]
    nest = _unique_names(sch, made, block)
    if not nest:
        raise TransplantError(f"the schedule of {block} binds no loop to GPU blocks or threads")
    writers = [name for name in nest if any(region.source.name == output
                                            for region in sch.get(sch.get_sblock(name)).writes)]
    if len(writers) != 1:
        raise TransplantError(f"{len(writers)} blocks of {block}'s schedule write its output")
    readers = tuple(sch.get(b).name_hint for b in sch.get_consumers(sch.get_sblock(writers[0])))
    return Replayed(block, tuple(nest), output, readers)


def _unique_names(sch: s_tir.Schedule, blocks, stage: str) -> list[str]:
    """The names of `blocks` (a replayed stage's), each made unique in the kernel: TVM names a cache or a
    re-indexed copy after its buffer, so two stages re-indexing the same input into shared memory made two
    blocks `s1_reindex_shared` (a transformer encoder's Q/K/V GEMMs; a ResNeXt block's input read by its
    first convolution and its shortcut), and every later lookup by name failed. A clashing block takes the
    stage's name as a suffix."""
    names = []
    for b in blocks:
        stmt = sch.get(b)
        name = stmt.name_hint
        if _count_named(sch, name) > 1:
            name = f"{name}_{stage}"
            renamed = s_tir.stmt.SBlock(stmt.iter_vars, stmt.reads, stmt.writes, name, stmt.body, stmt.init,
                                        stmt.alloc_buffers, stmt.match_buffers, stmt.annotations)
            sch.state.replace(sch.get_sref(b), renamed, {stmt: renamed})
        names.append(name)
    return names


def _count_named(sch: s_tir.Schedule, name: str) -> int:
    found = []
    tvm_ffi.structural_walk(sch.mod["main"].body, [(s_tir.stmt.SBlock, lambda b: found.append(b.name_hint == name))])
    return sum(found)


def bind_stage(sch: s_tir.Schedule, stage: Replayed, blocks: int):
    """The launch loops of a replayed stage rebound into the kernel's nest of `blocks` blocks x WARPS warps
    x WARP lanes. Returns (block loop, warp loop, lane loop (None for a tensor-core schedule, whose warps
    compute fragments), the block writing the stage's output); the caller merges the first two with the
    other stages' and binds them, then calls `decompose_marked`. Raises TransplantError."""
    nest = [sch.get_sblock(name) for name in stage.nest]
    _bindings_as_marks(sch, nest)
    prefix = _common_loops(sch, nest)
    on_block, on_warp, lane, pragmas = _rebind_launch(sch, prefix, blocks)
    _rebind_marked(sch, nest, stage.block, in_warps=lane is None)
    if lane is not None:
        _annotate_below(sch, nest, lane, pragmas)
    writers = [b for b in nest if any(region.source.name == stage.output for region in sch.get(b).writes)]
    if len(writers) != 1:
        raise TransplantError(f"{len(writers)} blocks of {stage.block}'s schedule write its output")
    return on_block, on_warp, lane, writers[0]


def _log_untiled_reduced_stages(func: tirx.PrimFunc, select: Callable) -> None:
    """Say why a float16 / bfloat16 GEMM stage that `select` (the grid kernel's tile) refuses stays off the
    tensor cores: computed in the kernel's own launch nest, on CUDA cores."""
    sch = s_tir.Schedule(func)
    for stage in compute_stages(func):
        block = sch.get_sblock(stage.block)
        if reduced_dtype(sch.get(block)) and not select(sch, block):
            *_, rows, cols, depth = (int(sch.get(loop).extent) for loop in sch.get_loops(block))
            log.info("stage %s stays on CUDA cores: its %d x %d x %d GEMM is not whole %d x %d x %d tiles of the "
                     "grid kernel", stage.block, rows, cols, depth, TILE, TILE, K_TILE)


def _unbound(trace: s_tir.schedule.Trace):
    """The trace as JSON with its reduction's init split deferred (a DECOMPOSE mark), the single child
    block of the stage's function found by name (the kernel's root has one child per stage), and queries
    whose answer went unused dropped (dlight asks for producers before inlining: the stage alone has none,
    a stage inside the kernel reads other stages). Its launch bindings stay while it replays, so that its
    shared-memory loads are placed (compute_at) over the block's threads; `_bindings_as_marks` then
    turns them into BOUND marks."""
    insts, decisions = trace.as_json(remove_postproc=False)
    init_fill, skipped = tensorized_init(insts)
    edited = []
    for kind, inputs, attrs, outputs in insts:
        if (kind in ("GetProducers", "GetConsumers") and not outputs) or any(o in skipped for o in outputs) \
                or (kind == "Tensorize" and inputs[0] in skipped):
            continue
        if kind == "Tensorize":  # after the kernel's other stages are scheduled (tensorize_marked)
            kind, inputs, attrs = "Annotate", [inputs[0], f'"{attrs[0]}"'], [TENSORIZE]
        elif kind == "DecomposeReduction":  # TVM binds threads only above whole reductions: after rebinding
            kind, inputs, attrs, outputs = ("Annotate", [inputs[1], f'"{init_fill}"' if init_fill else 1],
                                            [DECOMPOSE], [])
        elif kind == "GetChildBlocks" and len(outputs) == 1:
            kind, inputs, attrs = "GetSBlock", [], [STAGE, "main"]
        edited.append([kind, inputs, attrs, outputs])
    return edited, decisions


def _bindings_as_marks(sch, nest) -> None:
    """Each launch binding around the blocks of `nest` made a serial loop with a BOUND mark of its
    thread, for `_rebind_launch` to fuse and bind again (TVM fuses no bound loops). Replayed with these
    loops serial instead, compute_at would have sized each shared-memory load for one thread, and the
    loads rebound to the block's threads would have loaded almost nothing the others read (BERT-base's
    wrong results on an H100; `launches.thread_aliased_blocks` finds such loads)."""
    bound = []
    for b in nest:
        for loop in sch.get_loops(b):
            stmt = sch.get(loop)
            if stmt.thread_binding is not None and str(stmt.thread_binding.thread_tag).startswith(LAUNCH_TAGS) \
                    and not any(sch.get(other).same_as(stmt) for other in bound):
                bound.append(loop)
    for loop in reversed(bound):  # innermost first; loop srefs survive (same loop variables)
        stmt = sch.get(loop)
        marked = tirx.For(stmt.loop_var, stmt.min, stmt.extent, tirx.ForKind.SERIAL, stmt.body, None,
                          {**stmt.annotations, BOUND: str(stmt.thread_binding.thread_tag)})
        sch.state.replace(sch.get_sref(loop), marked)


def _annotate_below(sch, nest, lane, pragmas) -> None:
    """The thread loop's unrolling pragmas on each loop directly inside the lane loop (on the lane loop
    itself, TVM's LowerThreadAllreduce fails on the kernel's warp reductions), unrolled by nvcc."""
    below = {}
    for b in nest:
        loops = list(sch.get_loops(b))
        depth = next((i for i, loop in enumerate(loops) if sch.get(loop).same_as(sch.get(lane))), None)
        if depth is not None and depth + 1 < len(loops):
            below.setdefault(sch.get(loops[depth + 1]), loops[depth + 1])
    # unrolled by nvcc (#pragma unroll), not written out by TVM: the same code in a tenth of the source,
    # with fewer registers, and nvcc compiles it faster
    pragmas = {**pragmas, "pragma_unroll_explicit": 0} if pragmas else {}
    for loop in below.values():
        for key, value in pragmas.items():
            sch.annotate(loop, key, value)


def decompose_marked(sch) -> None:
    """Split the transplanted reductions' inits off where their schedules did (DECOMPOSE marks), once the
    kernel's launch loops are bound: TVM binds threads only above whole reductions."""
    for b in sch.get_child_blocks(sch.get_sblock("root")):
        if sch.get(b).init is None:
            continue
        marked = [loop for loop in sch.get_loops(b) if DECOMPOSE in sch.get(loop).annotations]
        if len(marked) > 1:
            raise TransplantError("the schedule decomposes one reduction twice")
        if marked:
            fill = sch.get(marked[0]).annotations[DECOMPOSE]
            sch.unannotate(marked[0], DECOMPOSE)
            init = sch.decompose_reduction(b, marked[0])
            if isinstance(fill, str):  # a tensor-core init: its fragments filled by the intrinsic
                sch.annotate(sch.get_loops(sch.get_child_blocks(init)[0])[-2], TENSORIZE, fill)


def _rebind_marked(sch, nest, what: str, in_warps: bool) -> None:
    """The cooperative loads' thread loops (BOUND marks inside the blocks of a stage's nest) rebound to
    the kernel's threads."""
    for b in nest:
        inner = [loop for loop in sch.get_loops(b) if BOUND in sch.get(loop).annotations]
        if inner:
            _rebind_threads(sch, inner, f"a load of {what}", in_warps)


def _common_loops(sch, nest) -> list:
    """The loops every block of the stage's nest sits in, outermost first."""
    common = list(sch.get_loops(nest[0]))
    for b in nest[1:]:
        loops = list(sch.get_loops(b))
        n = 0
        while n < min(len(common), len(loops)) and sch.get(common[n]).same_as(sch.get(loops[n])):
            n += 1
        common = common[:n]
    return common


def _tag(sch, loop) -> str:
    return str(sch.get(loop).annotations[BOUND])


def _rebind_launch(sch, prefix, blocks: int):
    """The stage's block loops as a grid-stride loop over `blocks`, its thread loops as warp x lane:
    (block loop, warp loop, lane loop), in that order at the top of the stage's nest; its vthreads and
    the thread loops' other annotations (unrolling) as they were. TVM reorders and fuses only loops
    without annotations, so they come off first."""
    tags = {i: _tag(sch, loop) for i, loop in enumerate(prefix) if BOUND in sch.get(loop).annotations}
    on_grid = [i for i, tag in tags.items() if tag.startswith("blockIdx.")]
    on_threads = [i for i, tag in tags.items() if tag.startswith("threadIdx.")]
    if not on_grid or not on_threads or on_grid != list(range(on_grid[0], on_grid[-1] + 1)) \
            or on_threads != list(range(on_threads[0], on_threads[-1] + 1)) or on_grid[-1] > on_threads[0]:
        raise TransplantError("the stage's block and thread loops are not two runs, blocks outside threads")
    middle = prefix[on_grid[-1] + 1:on_threads[0]]
    pragmas = {}
    for i in on_threads:
        pragmas.update({key: value for key, value in sch.get(prefix[i]).annotations.items() if key != BOUND})
    for i, loop in enumerate(prefix):
        for key in sch.get(loop).annotations.keys() if i in tags or i in on_threads else ():
            sch.unannotate(loop, key)
    grid = _fused(sch, [prefix[i] for i in on_grid])
    if _warp_level(sch, [prefix[i] for i in on_threads], [tags[i] for i in on_threads]):  # tensor cores
        # predicated while the kernel is scheduled (regions in bounds); per_block_tiles then drops the
        # predicates for a count of tiles per block, which tensorize admits
        tiles = int(sch.get(grid).extent)
        outer, on_block = sch.split(grid, [None, blocks])
        sch.annotate(outer, TILES, tiles)
        on_warp, lane = prefix[on_threads[0]], None
        sch.reorder(on_block, on_warp, outer, *middle)
    else:
        outer, on_block = sch.split(grid, [None, blocks])
        on_warp, lane = _warps_and_lanes(sch, [prefix[i] for i in on_threads], "the stage")
        sch.reorder(on_block, on_warp, outer, *middle, lane)
        sch.bind(lane, "threadIdx.x")
    for loop, i in zip(middle, range(on_grid[-1] + 1, on_threads[0])):
        if i in tags:
            sch.bind(loop, tags[i])
    return on_block, on_warp, lane, pragmas


def _warp_level(sch, loops, tags) -> bool:
    """Whether the stage's thread loops are its warps alone, WARPS of them (threadIdx.y): a tensor-core
    schedule, whose lanes work together inside each wmma intrinsic."""
    return tags == ["threadIdx.y"] and int(sch.get(loops[0]).extent) == WARPS


def _rebind_threads(sch, loops, what: str, in_warps: bool) -> None:
    """`loops` (a cooperative load's thread loops) bound to the kernel's warps and lanes; `in_warps`: the
    stage's own loops are its warps alone (a tensor-core stage), and a loop of one warp's lanes inside
    them (its accumulators' write-back) stays that warp's."""
    tags = [_tag(sch, loop) for loop in loops]
    if not all(tag.startswith("threadIdx.") for tag in tags):
        raise TransplantError(f"{what} is bound to {tags}: only threads may be bound inside the stage")
    for loop in loops:
        sch.unannotate(loop, BOUND)
    if in_warps and tags == ["threadIdx.x"] and int(sch.get(loops[0]).extent) == WARP:
        sch.bind(loops[0], "threadIdx.x")
        return
    on_warp, lane = _warps_and_lanes(sch, loops, what)
    sch.bind(on_warp, "threadIdx.y")
    sch.bind(lane, "threadIdx.x")


def _warps_and_lanes(sch, loops, what: str):
    """Thread loops (outermost first, adjacent) fused into one linear thread index and split into the
    kernel's WARPS x WARP: a stage with fewer threads leaves the rest idle (a block predicate)."""
    fused = _fused(sch, loops)
    threads = int(sch.get(fused).extent)
    if threads > THREADS:
        raise TransplantError(f"{what} uses {threads} threads per block; a grid kernel has {THREADS}")
    return sch.split(fused, [WARPS, WARP])


def _fused(sch, loops):
    return sch.fuse(*loops) if len(loops) > 1 else loops[0]



def check_shared_loads(sch) -> None:
    """Refuse a kernel whose transplanted shared-memory loads read a thread index that another loop of
    the same thread shadows: on the GPU they would load other elements than their TIR says."""
    aliased = thread_aliased_blocks(sch.mod["main"])
    if aliased:
        raise TransplantError(f"the loads {', '.join(aliased)} are sized for one thread, not for the block")
