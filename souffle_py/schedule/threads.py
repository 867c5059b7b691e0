"""Which loops run in parallel: a model of little work on one thread, a recurrence's steps on one
thread or in one parallel region (CPU). TVM shares a parallel loop out statically, so every launch and
every barrier waits for the slowest thread; these rules keep launches and barriers where they pay.
"""

from __future__ import annotations

import logging
import math

import tvm_ffi
from tvm import s_tir, tirx

from souffle_py.codegen.recurrence import TIME_LOOP, is_time_loop
from souffle_py.failures import not_applied
from souffle_py.schedule.blocks import block_loops, has_annotated_loop, leaf_blocks, loop_extent
from souffle_py.schedule.gates import merge_groups
from souffle_py.schedule.thresholds import MODEL_BYTES_MIN, MODEL_WORK_MIN, STEP_WORK_MIN
from souffle_py.ir.analysis.tensor_level import itemsize
from souffle_py.ir.exprs import substitute

log = logging.getLogger(__name__)



class OneThread:
    """`sch` with parallel() doing nothing: a rule applied through it keeps its block on one thread."""

    def __init__(self, sch):
        self._sch = sch

    def parallel(self, loop) -> None:
        pass

    def __getattr__(self, name):
        return getattr(self._sch, name)


def runs_on_one_thread(funcs) -> bool:
    """Whether a model of these kernels is too little work for threads: under MODEL_WORK_MIN block
    iterations and MODEL_BYTES_MIN bytes of buffers in all (a classifier GEMV streaming 5 MB of weights is
    faster on two). It gains a few microseconds from a second thread at best, and each parallel launch
    waits out any preemption of the other thread (TVM shares loops out statically): with one busy process
    beside them on 2 cores, the tiny test BERT took 16-32 ms instead of 0.05 and the tiny LSTM 8 ms
    instead of 6 us, while ONNX Runtime stayed at 0.12 ms. Quiet, one thread is faster for both too (BERT
    0.046 -> 0.031 ms, LSTM 5.6 -> 2.1 us). Decided per model, not per kernel: a large model's small
    kernels run between parallel ones, whose threads are awake and hold their data (one-threaded, the
    unfused EfficientNet-b0 was 10% slower)."""
    work, size = 0, 0
    for func in funcs:
        sch = s_tir.Schedule(func)
        buffers = {}
        for block in leaf_blocks(sch):
            work += _iterations(sch, sch.get_loops(block))
            for region in (*sch.get(block).reads, *sch.get(block).writes):
                buffers[region.source.name] = region.source
        size += sum(_bytes(buffer) for buffer in buffers.values())
        if work >= MODEL_WORK_MIN or size >= MODEL_BYTES_MIN:
            return False
    return True


def serial_recurrences(func: tirx.PrimFunc) -> tuple[set, set]:
    """(indices among time_loops_of, names of the blocks inside them) of the recurrences whose step has
    fewer than STEP_WORK_MIN block iterations: a barrier per step would cost more than a second thread
    saves, and each one waits out a preemption of the other thread. Queried on a schedule of its own, so
    that a stage's default trace records only its block's primitives and replays inside any kernel."""
    loops, names = set(), set()
    if not has_annotated_loop(func, TIME_LOOP):  # most kernels: no recurrence, no schedule to build
        return loops, names
    sch = s_tir.Schedule(func)
    blocks = leaf_blocks(sch)
    for i, time_loop in enumerate(time_loops_of(sch)):
        stmt = sch.get(time_loop)
        inside = [b for b in blocks if any(sch.get(l).same_as(stmt) for l in sch.get_loops(b))]
        if sum(_work(sch, block) for block in inside) < STEP_WORK_MIN:
            loops.add(i)
            names.update(sch.get(block).name_hint for block in inside)
    return loops, names


def _bytes(buffer) -> int:
    return math.prod(int(d) for d in buffer.shape if isinstance(d, tirx.IntImm)) * itemsize(str(buffer.dtype))


def _iterations(sch, loops) -> int:
    return math.prod(loop_extent(sch, loop) for loop in loops)


def _work(sch, block) -> int:
    """The block's iterations below any time loop (a GEMM's or conv's multiply-adds)."""
    return _iterations(sch, block_loops(sch, block))


def time_loops_of(sch) -> list:
    found = []
    for block in leaf_blocks(sch):
        for loop in sch.get_loops(block):
            if is_time_loop(sch, loop) and not any(sch.get(loop).same_as(sch.get(f)) for f in found):
                found.append(loop)
    return found


def one_parallel_region(sch, time_loop) -> None:
    """Run a recurrence's whole time loop in one parallel launch: every thread runs the loop, shares out
    each parallel loop of a step and meets the others at a barrier after it (TVM's parallel launch point
    and barrier pragmas) -- the CPU analogue of SOUFFLE's grid synchronization, instead of a fork/join
    per step. Each step's blocks must all have a parallel loop (a serial one would run on every thread);
    otherwise the steps keep their per-loop launches."""
    _elementwise_into_reader(sch, _step_blocks(sch, time_loop))
    try:  # an LSTM's gates and cell updates by groups of units (gates.py): one loop, no barrier between
        merge_groups(sch, _step_blocks(sch, time_loop))
    except Exception as exc:  # noqa: BLE001  (tvm.s_tir.ScheduleError: nothing changed)
        not_applied("gate group merge", "a recurrence step", exc, "its gate projections and cell updates apart")
    blocks = _step_blocks(sch, time_loop)  # the loop's statement changed with its body
    parallel = []
    for block in blocks:
        shared = _shared_loop(sch, block)
        if shared is None:
            return
        parallel.append(shared)
    for loop in parallel:
        if int(sch.get(loop).kind) != 1:
            sch.parallel(loop)
    marked = []
    for loop in parallel:
        if not any(sch.get(loop).same_as(sch.get(m)) for m in marked):
            sch.annotate(loop, "pragma_parallel_barrier_when_finish", 1)
            marked.append(loop)
    sch.annotate(time_loop, "pragma_parallel_launch_point", 1)


def _step_blocks(sch, time_loop) -> list:
    loop_stmt = sch.get(time_loop)
    return [b for b in leaf_blocks(sch) if any(sch.get(l).same_as(loop_stmt) for l in sch.get_loops(b))]


def _shared_loop(sch, block):
    """The loop a step's block is shared out over: its parallel loop, else its outermost one (None if that
    has one iteration: the block would run on every thread)."""
    inner = block_loops(sch, block)
    shared = [loop for loop in inner if int(sch.get(loop).kind) == 1]
    if shared:
        return shared[0]
    return inner[0] if inner and loop_extent(sch, inner[0]) >= 2 else None


def _elementwise_into_reader(sch, blocks) -> None:
    """Merge the loops of each elementwise block of a step with those of the next block where that is the
    block's only reader and reads it at its own point only, over the same loops: one parallel loop and a
    barrier fewer per step (an LSTM's cell state c = f * c + i * g and h = o * tanh(c)). Left as they are
    where TVM refuses."""
    for producer, reader in zip(blocks, blocks[1:]):
        readers = sch.get_consumers(producer)
        if len(readers) != 1 or not sch.get(readers[0]).same_as(sch.get(reader)) or not _pointwise(sch, producer, reader):
            continue
        try:
            sch.merge(block_loops(sch, producer)[0], block_loops(sch, reader)[0])
        except Exception as exc:  # noqa: BLE001  (tvm.s_tir.ScheduleError: nothing changed)
            not_applied("elementwise loop merge", sch.get(reader).name_hint, exc, "its own parallel loop")


def _pointwise(sch, producer, reader) -> bool:
    """Whether both blocks are elementwise over loops of the same extents and iteration domains, and the
    reader reads the producer's buffer at the point the producer writes in the same iteration."""
    first, second = sch.get(producer), sch.get(reader)
    if not all(isinstance(sch.get(loop).extent, tirx.IntImm) for b in (producer, reader) for loop in block_loops(sch, b)):
        return False
    loops = [[loop_extent(sch, loop) for loop in block_loops(sch, b)] for b in (producer, reader)]
    domains = [[(int(iv.dom.extent), int(iv.iter_type)) for iv in b.iter_vars] for b in (first, second)]
    if loops[0] != loops[1] or not loops[0] or domains[0] != domains[1] or any(t != 0 for _, t in domains[0]):
        return False
    if len(first.writes) != 1:
        return False
    bindings = [_binding(sch, b) for b in (producer, reader)]
    if None in bindings:
        return False
    loop_vars = {b.__chandle__(): a for a, b in zip(bindings[0][0], bindings[1][0])}
    if not all(tvm_ffi.structural_equal(substitute(r, loop_vars), p) for p, r in zip(bindings[0][1], bindings[1][1])):
        return False  # the same extents, but the loops bind the block's axes differently
    buffer, written = first.writes[0].source, first.writes[0].region
    same = {b.var.__chandle__(): a.var for a, b in zip(first.iter_vars, second.iter_vars)}
    for read in second.reads:
        if not read.source.same_as(buffer):
            continue
        for w, r in zip(written, read.region):
            mapped = substitute(r.min, same)
            if not (tvm_ffi.structural_equal(mapped, w.min) and int(r.extent) == int(w.extent) == 1):
                return False
    return True


def _binding(sch, block):
    """(the block's loop variables, the values its axes are bound to), or None if not found."""
    loops = block_loops(sch, block)
    target = sch.get(block)
    found = []
    tvm_ffi.structural_walk(sch.get(loops[-1]).body, [(s_tir.SBlockRealize, lambda r: found.append(r)
                                                       if r.block.same_as(target) else None)])
    if len(found) != 1:
        return None
    return [sch.get(loop).loop_var for loop in loops], list(found[0].iter_values)
