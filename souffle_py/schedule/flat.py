"""Vectorize memory-bound blocks whatever their shape: over a flattened index, with a tail.

An elementwise block over an NCHW map of 7 x 7, 14 x 14 or 58 channels, or a row of 197 (ViT's softmax),
has no innermost row that a vector width divides, and the row-wise rule (rules/injective.py) left it
one scalar loop. Here the vector runs over the fused index of the innermost axes along which every load and
the store are contiguous (h and w of an NCHW map: 49 elements, not rows of 7) and no if_then_else
condition varies (a concat folded into its reader selects by channel: uniform over h and w), in whole
vectors, the rest a loop of its own (TVM's partition): every vector's index then simplifies to a
contiguous ramp (a split with a predicate instead gathered element by element). A row whose conditions
compare its axis with constants (a pad's borders, a concat along the row) is cut at those constants into
plain loops that LLVM vectorizes.

Sums over ragged rows (a global average pool over 7 x 7, a softmax's sum over 197 or 49 columns) run in
a vector's partial-result lanes over their contiguous reduction axes fused (rfactor), whole vectors first and
the last one masked in a loop of its own (TVM's partition: masked under every vector, the loads were
gathers, 5x slower over softmax rows of 197): TVM's vectorizer masks it under
`tirx.enable_buffer_level_predication`, which souffle-py's CPU pipeline
sets (codegen/stack_locals.py). TVM 0.27's rfactor drops the split's predicate (it would read past the
row), so the partial-result block carries it as an annotation, `RAGGED`, which `restore_ragged_predicates`
makes its predicate again once the schedule is done.

Every partition waits until the rules have scheduled every other block (`partitions_last`): TVM's
loop_partition wraps its pieces in an opaque block, and a scope holding one is no longer a "stage
pipeline", where every later compute_at and reverse_compute_at fails. A pad cut early in a merged kernel
left each GEMM, conv and reduction after it unvectorized and serial (EdgeNeXt: 1% of peak, 6x ONNX Runtime).
A ragged GEMM's padded result folded into its predicated write-back waits too (ragged.inline_output_copy:
EdgeNeXt int8's GEMM tiles after one were refused), but runs before every partition (`before_partitions`),
itself a reverse_compute_inline that a partition's opaque block refuses (EdgeNeXt's attention GEMMs kept
their padded copies).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math

import tvm
import tvm_ffi
from tvm import s_tir, tirx

from souffle_py.errors import SouffleError
from souffle_py.failures import not_applied
from souffle_py.schedule.blocks import IF_THEN_ELSE, block_named, loop_extent, uses, vector_lanes
from souffle_py.schedule.thresholds import RAGGED_MIN_VECTORS
from souffle_py.ir.exprs import substitute

log = logging.getLogger(__name__)

RAGGED = "souffle.ragged_predicate"  # a partial-result block's predicate, which rfactor drops


def _loads(expr) -> list:
    found = []
    tvm_ffi.structural_walk(expr, [(tvm.ir.expr.TensorLoad, found.append)])
    return found


def conditions_of(expr) -> list:
    found = []
    tvm_ffi.structural_walk(expr, [(tvm.ir.Call, lambda c: found.append(c.args[0])
                                    if c.op.same_as(IF_THEN_ELSE) else None)])
    return found


def _flat_offset(indices, shape):
    offset, stride = tirx.IntImm("int64", 0), 1
    for index, extent in reversed(list(zip(indices, shape))):
        offset = offset + tirx.Cast("int64", index) * stride
        stride *= extent
    return offset


def _contiguous(analyzer, indices, shape, suffix, strided: bool = False) -> bool:
    """Whether the access's flat offset is `base + fused(suffix)` (row-major over the suffix's extents,
    base independent of it) or independent of the suffix (broadcast over the vector); with `strided`, also
    `base + s * fused(suffix)` for a constant s (a map stored in channel blocks read along its rows)."""
    if not all(isinstance(d, tirx.IntImm) for d in shape):
        return False
    offset = analyzer.simplify(_flat_offset(indices, [int(d) for d in shape]))
    if not any(uses(offset, iv.var) for iv in suffix):
        return True
    fused, stride = tirx.IntImm("int64", 0), 1
    for iv in reversed(suffix):
        fused = fused + tirx.Cast("int64", iv.var) * stride
        stride *= int(iv.dom.extent)
    if not any(uses(analyzer.simplify(offset - fused), iv.var) for iv in suffix):
        return True
    inner = next((iv for iv in reversed(suffix) if int(iv.dom.extent) > 1), None)
    if not strided or inner is None:
        return False
    # the offset's step along the innermost axis longer than one, the suffix's others at their first value
    at = lambda v: substitute(offset, {iv.var.__chandle__(): iv.var * 0 + (v if iv.same_as(inner) else 0)
                                       for iv in suffix})
    step = analyzer.simplify(at(1) - at(0))
    if not isinstance(step, tirx.IntImm) or step.value < 1:
        return False
    base = analyzer.simplify(offset - fused * step.value)
    return not any(uses(base, iv.var) for iv in suffix)


def contiguous_suffix(stmt, iter_vars, store_indices=None, conditions: bool = True, strided_loads: bool = False) -> int:
    """How many of the innermost `iter_vars` (the block's, in loop order) form one contiguous run in every
    load of `stmt`'s value and in its store, with no if_then_else condition depending on them: the axes a
    flattened vector can run over (conditions=False: whatever the conditions; strided_loads: loads may
    also step by a constant stride, gathered lanes). 0 where not even the innermost one qualifies."""
    analyzer = tvm.sym.Analyzer()
    for iv in stmt.iter_vars:
        analyzer.bind(iv.var, tvm.ir.Range(iv.dom.min, iv.dom.min + iv.dom.extent))
    body = stmt.body
    if not isinstance(body, tirx.BufferStore):
        return 0
    loads = _loads(body.value)
    conditions = conditions_of(body.value) if conditions else []
    accesses = [(load.indices, load.source.shape, strided_loads) for load in loads]
    if store_indices is not False:
        accesses.append((body.indices, body.buffer.shape, False))
    best = 0
    for k in range(1, len(iter_vars) + 1):
        suffix = list(iter_vars[-k:])
        if any(uses(c, iv.var) for c in conditions for iv in suffix):
            break
        if not all(_contiguous(analyzer, indices, shape, suffix, strided) for indices, shape, strided in accesses):
            break
        best = k
    return best


_LATER: contextvars.ContextVar = contextvars.ContextVar("souffle_partitions_later", default=None)


@contextlib.contextmanager
def partitions_last():
    """Within it, the partitions of this module wait; they run, in order, when it closes (module docstring).
    A partition that fails is logged and the others still run: the block keeps its valid, slower schedule."""
    later: list = []
    token = _LATER.set(later)
    try:
        yield
    finally:
        _LATER.reset(token)
    later.sort(key=lambda step: not step[4])  # stable: the steps before partitions first, in their order
    for name, action, what, fallback, _, sch in later:
        if sch is not None and block_named(sch, name) is None:
            log.debug("%s: computed in another block's nest by now (an epilogue fused), %s skipped", name, what)
            continue
        try:
            action()
        except Exception as exc:  # noqa: BLE001  (tvm.s_tir.ScheduleError: checked before anything changes)
            not_applied(what, name, exc, fallback)


def when_scheduled(name: str, action, what: str = "loop partition", fallback: str = "its loops unpartitioned",
                   before_partitions: bool = False, sch=None):
    """`action` (the partition of block `name` and what follows it, or another step that ends the scope's
    stage pipeline: ragged.inline_output_copy) now, or at the close of partitions_last; `what` failed and
    the block keeps `fallback` where it raises. `before_partitions`: a step that needs the stage pipeline
    itself runs before every partition (in the order registered). `sch`: the step is skipped where block
    `name` is gone by then (an int8 GEMM's requantizing epilogue, inlined into its write-back after the
    padded result's fold: ConvNeXt-T int8's partition of it failed, "the loop no longer exists")."""
    later = _LATER.get()
    if later is None:
        action()
    else:
        later.append((name, action, what, fallback, before_partitions, sch))


def flat_lanes(extent: int) -> int:
    """Lanes for a flattened run of `extent` elements: vector_lanes(), or for a shorter run the widest power of two
    (at least 4) within it (7 -> 4, 14 -> 8); the rest is a scalar tail."""
    if extent >= vector_lanes():
        return vector_lanes()
    return max(4, 1 << (extent.bit_length() - 1))


def vectorize_injective(sch, block, loops, time_axes: int, parallel_min: int) -> bool:
    """Fuse the contiguous innermost loops of an injective block, split them in whole vectors and a tail loop
    of its own, fuse the rest into one parallel loop (a run covering the whole block: its vectors are the
    parallel loop). False (nothing changed) where no such run has 4 elements or more."""
    stmt = sch.get(block)
    iter_vars = list(stmt.iter_vars)[time_axes:]
    if len(iter_vars) != len(loops):
        return False
    k = contiguous_suffix(stmt, iter_vars, strided_loads=True)
    extent = math.prod(loop_extent(sch, loop) for loop in loops[len(loops) - k:]) if k else 1
    if extent < 4:
        return False
    total = math.prod(loop_extent(sch, loop) for loop in loops)
    inner = loops[len(loops) - k:]
    run = sch.fuse(*inner) if len(inner) > 1 else inner[0]
    lanes = flat_lanes(extent)
    prefix = loops[:len(loops) - k]
    outer = (sch.fuse(*prefix) if len(prefix) > 1 else prefix[0]) if prefix else None
    if outer is not None and total >= parallel_min and loop_extent(sch, outer) > 1:
        sch.parallel(outer)
    vectorize_run(sch, block, run, parallel_vectors=(outer is None or loop_extent(sch, outer) == 1)
                  and total >= parallel_min)
    log.debug("%s vectorized over a flat run of %d (%d lanes, a tail of %d)", stmt.name_hint, extent, lanes,
              extent % lanes)
    return True


def cut_points(conditions, var, extent: int):
    """Where the innermost axis `var` must be cut so that every condition is the same along each piece: the
    constants it is compared with (a concat's boundary, a pad's borders). None where a condition uses it
    otherwise (a rotary embedding's j % 8)."""
    cuts = set()
    comparisons = (tirx.LT, tirx.LE, tirx.GT, tirx.GE)

    def visit(expr):
        if isinstance(expr, (tirx.And, tirx.Or)):
            return visit(expr.a) and visit(expr.b)
        if isinstance(expr, tirx.Not):
            return visit(expr.a)
        if not uses(expr, var):
            return True
        if not isinstance(expr, comparisons):
            return False
        a, b = expr.a, expr.b
        if a.same_as(var) and isinstance(b, tirx.IntImm):
            bound, var_left = b.value, True
        elif b.same_as(var) and isinstance(a, tirx.IntImm):
            bound, var_left = a.value, False
        else:
            return False
        # the first index where the comparison's value changes: v < c, c <= v, v >= c, c > v at c; else c + 1
        strict_left = isinstance(expr, (tirx.LT, tirx.GE)) if var_left else isinstance(expr, (tirx.LE, tirx.GT))
        cuts.add(bound if strict_left else bound + 1)
        return True

    if not all(visit(condition) for condition in conditions):
        return None
    return sorted(c for c in cuts if 0 < c < extent)


def vectorize_run(sch, block, run, parallel_vectors: bool = False) -> None:
    """The loop `run` of `block` (contiguous in its every access) in whole vectors and a tail loop of its own:
    every vector loads contiguously. `parallel_vectors`: the loop over the vectors runs in parallel (a run
    that covers the whole block)."""
    extent = loop_extent(sch, run)
    lanes = flat_lanes(extent)
    whole = extent // lanes * lanes

    def vectorize(run=run):
        if whole < extent:
            run, _tail = sch.loop_partition(run, [whole, None])
        vectors, lane = sch.split(run, [None, lanes])
        sch.vectorize(lane)
        if parallel_vectors and loop_extent(sch, vectors) > 1:
            sch.parallel(vectors)

    if whole < extent:
        when_scheduled(sch.get(block).name_hint, vectorize, sch=sch)
    else:
        vectorize()


def cut_at_conditions(sch, block, loops, time_axes: int, parallel_min: int) -> bool:
    """A padding block (rules/padding.py; elementwise blocks keep their rule: cutting Swin-B's rows made it
    1.5x slower, not yet understood) whose if_then_else conditions compare the innermost axis with
    constants (a pad's borders, a concat along the row): the row cut at those constants into loops of
    their own, in each of which TVM simplifies the condition away under the piece's bounds and LLVM
    vectorizes the plain contiguous loop (a ShuffleNet pad of 58 x 30 x 30 with its BN + ReLU 12 -> 3 us);
    the outer loops fused and parallel. Not vectorized here: TVM's loop_partition gives pieces that start
    past 0, which `split` refuses (and a second partition of one drops an element). False (nothing
    changed) where a condition uses the axis otherwise or a load is not contiguous along it."""
    stmt = sch.get(block)
    iter_vars = list(stmt.iter_vars)[time_axes:]
    if len(iter_vars) != len(loops) or not isinstance(stmt.body, tirx.BufferStore) or len(loops) < 2:
        return False
    extent = loop_extent(sch, loops[-1])
    cuts = cut_points(conditions_of(stmt.body.value), iter_vars[-1].var, extent)
    if not cuts or extent < 4 or contiguous_suffix(stmt, iter_vars[-1:], conditions=False) != 1:
        return False
    total = math.prod(loop_extent(sch, loop) for loop in loops)
    outer = sch.fuse(*loops[:-1]) if len(loops) > 2 else loops[0]
    if total >= parallel_min and loop_extent(sch, outer) > 1:
        sch.parallel(outer)
    bounds = [0, *cuts, extent]
    when_scheduled(stmt.name_hint, lambda: sch.loop_partition(
        loops[-1], [hi - lo for lo, hi in zip(bounds, bounds[1:-1])] + [None]), sch=sch)
    log.debug("%s cut in %d pieces of its row at %s", stmt.name_hint, len(bounds) - 1, cuts)
    return True


def ragged_reduction_lanes(sch, block, reduce_loops) -> int:
    """Lanes of partial results for a sum whose contiguous reduction run (its innermost reduction axes,
    fused: a 14 x 14 pool's 196 terms) has at least RAGGED_MIN_VECTORS vectors of terms; 0 otherwise. For reductions whose
    innermost axis alone no vector width divides (reductions.py `reduces_in_vector_lanes` found none)."""
    stmt = sch.get(block)
    reduce_vars = [iv for iv in stmt.iter_vars if int(iv.iter_type) == 2]
    if len(reduce_vars) != len(reduce_loops) or not reduce_vars:
        return 0
    if not isinstance(stmt.body, tirx.BufferStore) or not isinstance(stmt.body.value, tirx.Add):
        return 0  # sums only: TVM's vectorizer scalarizes a predicated max (LLVM vectorizes the plain loop)
    k = contiguous_suffix(stmt, reduce_vars, store_indices=False)
    extent = math.prod(int(iv.dom.extent) for iv in reduce_vars[len(reduce_vars) - k:]) if k else 0
    if extent < RAGGED_MIN_VECTORS * vector_lanes():
        return 0
    return vector_lanes()


def vectorize_ragged_reduction(sch, block, row, reduce_loops, lanes: int, place: bool = False) -> None:
    """Partial results in `lanes` vector lanes over the fused contiguous reduction run, its last vector
    masked: rfactor, then the predicate rfactor drops kept as the RAGGED annotation. `place`: the block moves
    under `row` too (rules/row_chain.py)."""
    stmt = sch.get(block)
    reduce_vars = [iv for iv in stmt.iter_vars if int(iv.iter_type) == 2]
    k = contiguous_suffix(stmt, reduce_vars, store_indices=False)
    inner = reduce_loops[len(reduce_loops) - k:]
    extent = math.prod(loop_extent(sch, loop) for loop in inner)
    run = sch.fuse(*inner) if len(inner) > 1 else inner[0]
    outer, lane = sch.split(run, [None, lanes])
    ndim = len(stmt.writes[0].region)
    partial = sch.rfactor(lane, factor_axis=ndim)
    sch.annotate(partial, RAGGED, [extent, lanes])
    sch.set_scope(partial, 0, "local")
    if place:
        sch.compute_at(block, row)
    sch.compute_at(partial, row)
    n_reduce = len(reduce_loops) - k + 1
    p_lane, *p_reduce = sch.get_loops(partial)[-(n_reduce + 1):]  # compute_at: iter-var order, lane first
    sch.reorder(*p_reduce, p_lane)
    sch.vectorize(p_lane)
    init = sch.decompose_reduction(partial, p_reduce[0])
    sch.unannotate(init, RAGGED)  # the initial values cover every lane
    sch.vectorize(sch.get_loops(init)[-1])
    vectors = loop_extent(sch, p_reduce[-1])
    if extent % lanes and vectors > 1:  # whole vectors apart from the masked last one (a masked load
        # gathers lane by lane: 5x slower over rows of 197)
        when_scheduled(stmt.name_hint, lambda: sch.loop_partition(p_reduce[-1], [vectors - 1, None]), sch=sch)
    log.debug("%s reduces a ragged run of %d in %d masked lanes", stmt.name_hint, extent, lanes)


def restore_ragged_predicates(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` with each RAGGED annotation of a reduction block made its predicate (over the block's loop
    bindings). Raises SouffleError where the annotation's variables are not the block's: without its
    predicate the block would read past its rows."""
    found, refused = [], []

    def restore(realize):
        block = realize.block
        if RAGGED not in block.annotations or not any(int(iv.iter_type) == 2 for iv in block.iter_vars):
            return realize
        extent, lanes = (int(x) for x in block.annotations[RAGGED])
        # rfactor's block: the lanes' axis first, then the block's spatial axes, then its reduction axes, the
        # ragged run's vectors last
        (first, lane), *_, (last, vector) = zip(block.iter_vars, realize.iter_values)
        if not (int(first.iter_type) == 0 and int(first.dom.extent) == lanes and int(last.iter_type) == 2):
            refused.append(block.name_hint)
            return realize
        end = (int(last.dom.min) + int(last.dom.extent)) * lanes
        if end <= extent:  # the whole vectors of a partitioned run: nothing to mask
            found.append(block.name_hint)
            return realize
        restored = vector * lanes + lane < extent
        found.append(block.name_hint)
        predicate = realize.predicate
        always = isinstance(predicate, tirx.IntImm) and predicate.value == 1
        return s_tir.stmt.SBlockRealize(realize.iter_values, restored if always else tirx.And(predicate, restored),
                                        block)

    body = tvm_ffi.structural_map(func.body, [(s_tir.stmt.SBlockRealize, restore)])
    if refused:
        raise SouffleError(f"block {refused[0]}: not rfactor's partial results, its ragged-row predicate "
                           "cannot be restored")
    return func.with_body(body) if found else func
