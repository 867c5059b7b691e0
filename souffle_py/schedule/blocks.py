"""What a TIR sblock of a CPU kernel is: its kind (GEMM, conv, reduction, pad, injective), its loops below
any recurrence's time loop, and how its loads vary along a would-be vector axis. Pure queries on a
schedule, shared by the default rules (rules/), tuning and the GPU backend; nothing here schedules.
"""

from __future__ import annotations

import math

import tvm
import tvm_ffi
from tvm import tirx

from souffle_py.codegen.recurrence import is_time_loop
from souffle_py.cpu_target import CpuTarget
from souffle_py.schedule.thresholds import PARALLEL_MIN
from souffle_py.ir.exprs import is_cheap_call, is_pad_value

IF_THEN_ELSE = tvm.ir.Op.get("prim.if_then_else")


def vector_lanes() -> int:
    """float32 lanes of a vector of the CPU being compiled for (16 with AVX-512, 8 with AVX2, 4 with NEON):
    cpu_target.CpuTarget.current(), set by the CPU backend around its work."""
    return CpuTarget.current().lanes


def vector_registers() -> int:
    """Vector registers of the CPU being compiled for (32 with AVX-512 and on AArch64, 16 with AVX2)."""
    return CpuTarget.current().registers




def leaf_blocks(sch):
    return list(sch.get_child_blocks(sch.get_sblock("root")))


def block_named(sch, name: str):
    """The block `name` of `sch`, or None where it is gone (inlined, or computed in another block's nest)."""
    try:
        return sch.get_sblock(name)
    except Exception:  # noqa: BLE001  (TVM raises a ScheduleError or ValueError for a name it does not find)
        return None


def block_loops(sch, block) -> list:
    """The block's loops below any recurrence's time loop, which stays serial (codegen/recurrence.py)."""
    loops = list(sch.get_loops(block))
    inner = [i for i, loop in enumerate(loops) if is_time_loop(sch, loop)]
    return loops[inner[-1] + 1:] if inner else loops


def loop_extent(sch, loop) -> int:
    return int(sch.get(loop).extent)


def block_kind(sch, block) -> str:
    """'gemm', 'conv', 'reduction', 'pad' or 'injective', from the block's iteration types and body."""
    stmt = sch.get(block)
    reduce_vars = [iv for iv in stmt.iter_vars if int(iv.iter_type) == 2]
    spatial_vars = [iv for iv in stmt.iter_vars if int(iv.iter_type) == 0]
    if not reduce_vars:
        return "pad" if _is_padding(stmt.body) else "injective"
    if len(reduce_vars) == 1 and len(spatial_vars) >= 2 and _is_product_of_loads(stmt.body):
        return "gemm"
    if len(reduce_vars) > 1 and spatial_vars and _is_product_of_loads(stmt.body):
        return "conv"
    return "reduction"


def _is_product_of_loads(body) -> bool:
    """C[..] = C[..] + A[..] * B[..]: the update of a matrix product."""
    if not isinstance(body, tirx.BufferStore) or not isinstance(body.value, tirx.Add):
        return False
    product = body.value.b
    return isinstance(product, tirx.Mul) and all(_is_operand(x) for x in (product.a, product.b))


def _is_operand(expr) -> bool:
    """A load, a load widened to float32 (a float16 / bfloat16 GEMM operand, te_passes/precision.py), or a
    choice between loads and constants (a recurrence's state: the initial value at t = 0)."""
    if isinstance(expr, tvm.ir.expr.TensorLoad):
        return True
    if isinstance(expr, tirx.Cast):
        return isinstance(expr.value, tvm.ir.expr.TensorLoad)
    return (isinstance(expr, tvm.ir.Call) and expr.op.same_as(IF_THEN_ELSE)
            and all(isinstance(x, (tvm.ir.expr.TensorLoad, tirx.FloatImm, tirx.IntImm)) for x in expr.args[1:]))


def _is_padding(body) -> bool:
    """out[..] = if_then_else(inside, x[..], constant): a padded copy (topi.nn.pad, topi.nn.dilate)."""
    return isinstance(body, tirx.BufferStore) and is_pad_value(body.value)


def has_annotated_loop(func: tirx.PrimFunc, key: str) -> bool:
    """Whether a loop of `func` carries the annotation `key` (a recurrence's time loop, a streamed piece)."""
    found = []
    tvm_ffi.structural_walk(func.body, [(tirx.For, lambda loop: found.append(key in loop.annotations))])
    return any(found)


def uses(expr, var) -> bool:
    found = []
    tvm_ffi.structural_walk(expr, [(tvm.ir.expr.Var, lambda v: found.append(v) if v.same_as(var) else None)])
    return bool(found)


def lane_access(load, var, lanes: int) -> str:
    """How `load` varies along the lanes of `var` split as (outer * lanes + lane): 'invariant', 'contiguous'
    (one element per lane along the last index only) or 'gather'. As for the vectorizer, only the lane's
    range is known (and that the outer index is not negative)."""
    outer, lane = tirx.Var("outer", "int32"), tirx.Var("lane", "int32")

    def analyzer():
        a = tvm.sym.Analyzer()
        a.bind(outer, tvm.ir.Range(0, 1 << 30))
        a.bind(lane, tvm.ir.Range(0, lanes))
        return a

    steps = []
    for index in load.indices:
        with_lane, without = analyzer(), analyzer()
        with_lane.bind(var, outer * lanes + lane)
        without.bind(var, outer * lanes)
        steps.append(analyzer().simplify(with_lane.simplify(index) - without.simplify(index)))
    invariant = [isinstance(s, tirx.IntImm) and s.value == 0 for s in steps]
    if all(invariant):
        return "invariant"
    # the innermost dimension longer than one: X[0, c, 0, 0] of a [1, C, 1, 1] map is contiguous along c
    shape = [int(d) if isinstance(d, tirx.IntImm) else 0 for d in load.source.shape]
    last = max((i for i, d in enumerate(shape) if d != 1), default=len(steps) - 1)
    rest = invariant[:last] + invariant[last + 1:]
    if all(rest) and steps[last].same_as(lane):
        return "contiguous"
    # a reshape composed into the read (a flatten before a classifier: X[0, k // 36, k % 36 // 6, k % 6]) is
    # contiguous in the flattened buffer, where TVM's simplifier makes the address k before vectorizing
    if not all(shape):
        return "gather"
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    flat = analyzer().simplify(sum((index * stride for index, stride in zip(load.indices, strides)),
                                   tirx.const(0, "int32")))
    with_lane, without = analyzer(), analyzer()
    with_lane.bind(var, outer * lanes + lane)
    without.bind(var, outer * lanes)
    step = analyzer().simplify(with_lane.simplify(flat) - without.simplify(flat))
    return "contiguous" if step.same_as(lane) else "gather"


def operand_loads(operand) -> list:
    """The loads of a product operand's value: the load itself, one under a cast (a float16 / bfloat16
    operand widened), the values of an if_then_else or select (a padded input, a masked one), or every load
    of any other expression; never those of a condition."""
    if isinstance(operand, tvm.ir.expr.TensorLoad):
        return [operand]
    if isinstance(operand, tirx.Cast):
        return operand_loads(operand.value)
    if isinstance(operand, tvm.ir.Call) and operand.op.same_as(IF_THEN_ELSE):
        return [load for value in operand.args[1:] for load in operand_loads(value)]
    if isinstance(operand, tirx.Select):
        return operand_loads(operand.true_value) + operand_loads(operand.false_value)
    found = []
    tvm_ffi.structural_walk(operand, [(tvm.ir.expr.TensorLoad, found.append)])
    return found


def calls_function(body, rounding: bool = False) -> bool:
    """Whether the body calls a function (exp, sigmoid: EfficientNet's SiLU); a NaN check is a comparison.
    `rounding`: a rounding (a requantization's nearbyint, one instruction) not counted either."""
    found = []
    tvm_ffi.structural_walk(body, [(tvm.ir.Call, lambda c: None if is_cheap_call(c) or rounding and _is_rounding(c)
                                    else found.append(True))])
    return bool(found)


def _is_rounding(call) -> bool:
    return isinstance(call.op, tvm.ir.Op) and call.op.name == "tirx.nearbyint"


def has_condition(body, uniform=()) -> bool:
    """Whether the body selects between values with if_then_else (a concat, a rotary embedding's halves)
    under a condition that depends on more than the variables `uniform` (those other than the vector's
    axis: then the condition is the same for every lane). TVM 0.27's vectorizer miscompiles some
    lane-dependent ones (a rotary embedding composed by the vertical pass, if_then_else(4 <= j % 8, ...)
    over a fused loop, gave values of 1e35): such loops stay scalar."""
    conditions = []
    tvm_ffi.structural_walk(body, [(tvm.ir.Call, lambda c: conditions.append(c.args[0])
                                    if c.op.same_as(IF_THEN_ELSE) else None)])
    allowed = {v.__chandle__() for v in uniform}
    for condition in conditions:
        used = []
        tvm_ffi.structural_walk(condition, [(tirx.Var, used.append)])
        if not used or any(v.__chandle__() not in allowed for v in used):
            return True
    return False


def stores_bool(sch, block) -> bool:
    """Whether the block writes a bool buffer: LLVM lowers a bool vector as int8 lanes, which TVM refuses
    to store into a bool buffer (masks stay scalar; they are small and read by vectorized consumers)."""
    return any(str(region.source.dtype) == "bool" for region in sch.get(block).writes)


def weight_panel(sch, block):
    """The load of the weights when the block reads them packed in panels, W[.., j // P, k, j % P], else
    None."""
    stmt = sch.get(block)
    reduce_vars = [iv.var for iv in stmt.iter_vars if int(iv.iter_type) == 2]
    product = stmt.body.value.b
    for load in (product.a, product.b):
        if not (isinstance(load, tvm.ir.expr.TensorLoad) and len(load.indices) >= 3 and len(reduce_vars) == 1):
            continue
        *_, panel_of, reduce_index, in_panel = load.indices
        if (isinstance(panel_of, tirx.FloorDiv) and isinstance(in_panel, tirx.FloorMod)
                and reduce_index.same_as(reduce_vars[0]) and panel_of.a.same_as(in_panel.a)
                and isinstance(panel_of.b, tirx.IntImm) and isinstance(in_panel.b, tirx.IntImm)
                and panel_of.b.value == in_panel.b.value == int(load.source.shape[-1])):
            return load
    return None


def gathered_column_loads(sch, block) -> list:
    """The operand loads of the GEMM `block` that a vector of columns would gather element by element."""
    stmt = sch.get(block)
    column = [iv for iv in stmt.iter_vars if int(iv.iter_type) == 0][-1].var
    product = stmt.body.value.b
    return [load for operand in (product.a, product.b) for load in operand_loads(operand)
            if uses(load, column) and lane_access(load, column, vector_lanes()) == "gather"]


def columns_gather(sch, block) -> bool:
    """Whether an operand of the GEMM `block` is read across its columns (a classifier's W[j, k]): a vector of
    columns would gather it element by element (MobileNetV3's 576 -> 1024 GEMV: 1.7 GFLOP/s)."""
    return bool(gathered_column_loads(sch, block))


def unrolled_window(stmt, taps: int) -> bool:
    """Whether a conv block's innermost reduction (of more than one step) is a kernel window of at most
    `taps` steps, unrolled (by the conv rule where its tile's registers allow, else by LLVM where small): a
    3x3 conv's kw, a 7x1 conv's kh; not a 1x1 conv's channels."""
    extents = [int(iv.dom.extent) for iv in stmt.iter_vars if int(iv.iter_type) == 2 and int(iv.dom.extent) > 1]
    return len(extents) > 1 and extents[-1] <= taps


def blocked_reductions(stmt, loads) -> dict[int, int]:
    """{position among the reduction iter vars: b} for each reduction axis r that `loads` index as r // b
    and r % b (a conv over channel blocks, x[r // 32, y, x, r % 32]; also g * 32 + r in a group), b one
    factor dividing its extent. Split at b, every load's index is an axis of its own: LLVM kept the
    division in a ResNet 3x3 conv's inner loop, 110 against 174 GFLOP/s on a core."""
    reduce_vars = [iv for iv in stmt.iter_vars if int(iv.iter_type) == 2]
    found: dict[int, set] = {i: set() for i in range(len(reduce_vars))}

    def visit(expr):
        if isinstance(expr.b, tirx.IntImm) and expr.b.value > 1:
            for i, iv in enumerate(reduce_vars):
                if _is_var_plus_multiple(expr.a, iv.var, int(expr.b.value)):
                    found[i].add(int(expr.b.value))

    for load in loads:
        for index in load.indices:
            tvm_ffi.structural_walk(index, [(tirx.FloorDiv, visit), (tirx.FloorMod, visit)])
    blocked = {}
    for i, factors in found.items():
        extent = int(reduce_vars[i].dom.extent)
        if len(factors) == 1 and extent % min(factors) == 0 and extent > min(factors):
            blocked[i] = min(factors)
    return blocked


def _is_var_plus_multiple(expr, var, factor: int) -> bool:
    """expr is var, or var plus a multiple of `factor` (a group's offset g * 32 + r)."""
    if isinstance(expr, tirx.Var):
        return expr.same_as(var)
    if isinstance(expr, tirx.Add):
        for a, b in ((expr.a, expr.b), (expr.b, expr.a)):
            if (a.same_as(var) and isinstance(b, tirx.Mul) and isinstance(b.b, tirx.IntImm)
                    and int(b.b.value) % factor == 0):
                return True
    return False


def realize_predicate(sch, block):
    """The predicate of `block`'s realization (T.where), None when it has none. Read through the block's
    sref: no instruction enters the schedule's trace."""
    found, stmt = [], sch.get(block)
    tvm_ffi.structural_walk(sch.get_sref(block).parent.stmt, [(
        tvm.s_tir.stmt.SBlockRealize, lambda r: found.append(r.predicate) if r.block.same_as(stmt) else None)])
    predicate = found[0] if found else None
    return None if predicate is None or isinstance(predicate, tirx.IntImm) and predicate.value == 1 else predicate


def conjuncts_kept(after, before) -> bool:
    """Whether every conjunct of the predicate `before` is one of `after`'s (None: always true)."""
    def conjuncts(p):
        return [] if p is None else conjuncts(p.a) + conjuncts(p.b) if isinstance(p, tirx.And) else [p]
    kept = conjuncts(after)
    return all(any(tvm_ffi.structural_equal(c, k) for k in kept) for c in conjuncts(before))
