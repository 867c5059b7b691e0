"""Expression helpers shared by the rewrites: variable substitution, index simplification, and the
recompute cost model that decides whether inlining a TE into its readers is worth it.

Why a cost model: inlining a producer into a reader evaluates the producer's body once per read, so a TE
read by several readers, or by a reduction that reuses each element, is computed again per read. Pure data
movement (reshape, transpose, slice, broadcast) costs nothing to recompute -- only index arithmetic --
while a transcendental in a GEMM's operand would be recomputed once per multiply-add.
"""

from __future__ import annotations

import math
from typing import Mapping

import tvm
import tvm_ffi
from tvm import te
from tvm.ir.prim import expr as pe
from tvm.sym import Analyzer

from souffle_py.ir.analysis.body import IF_THEN_ELSE, contains_read, index_signature, reads, weighted_data_nodes
from souffle_py.ir.graph import TENSOR_LOAD, tensor_key

# Weight of an operation that costs several additions: intrinsic calls (exp, erf, tanh, sigmoid, sqrt,
# pow, log are polynomial or iterative evaluations of ~10-20 flops) and float division/modulo.
EXPENSIVE_OP = 8
_CHEAP = (pe.Add, pe.Sub, pe.Mul, pe.Min, pe.Max, pe.CmpExpr, pe.LogicalExpr, pe.Not, pe.BitwiseNot)
_EXPENSIVE = (pe.Div, pe.Mod, pe.FloorDiv, pe.FloorMod)
# intrinsic calls that are one comparison (vcmpunordps, ...), not a function evaluation: the NaN checks of
# souffle_py/frontend/ops/ieee.py and the fast-math guard
CHEAP_CALLS = frozenset({"tirx.isnan", "tirx.isinf", "tirx.isfinite"})


def is_cheap_call(call) -> bool:
    return isinstance(call.op, tvm.ir.Op) and call.op.name in CHEAP_CALLS


def is_pad_value(value) -> bool:
    """Whether a stored value is if_then_else(inside, x[..], constant): a padded copy (topi.nn.pad,
    topi.nn.dilate), in a TE body or a TIR store alike."""
    return (isinstance(value, tvm.ir.Call) and value.op.same_as(IF_THEN_ELSE)
            and isinstance(value.args[2], (tvm.tirx.IntImm, tvm.tirx.FloatImm)))


def substitute(expr, mapping: Mapping[int, object]):
    """`expr` with each variable whose handle is a key of `mapping` replaced by the mapped expression."""
    if not mapping:
        return expr
    return tvm_ffi.structural_map(expr, [(tvm.ir.Var, lambda v: mapping.get(v.__chandle__(), v))])


def uses(expr, var) -> bool:
    """Whether `expr` reads the variable `var`."""
    hits = []
    tvm_ffi.structural_walk(expr, [(tvm.tirx.Var, lambda v: hits.append(v.same_as(var)))])
    return any(hits)


def simplify_indices(expr, iter_vars):
    """`expr` with every read's indices simplified, knowing each iteration variable's range.

    Composing a reshape with its inverse leaves `(i * 16 + j) // 16`; simplified it is `i`, which keeps both
    the generated code and the isl maps plain.
    """
    analyzer = Analyzer()
    for iv in iter_vars:
        analyzer.bind(iv.var, iv.dom)

    def visit(call):
        if not call.op.same_as(TENSOR_LOAD):
            return call
        # an index computed from data (a Gather's) stays as it is: the analyzer cannot look into a read
        indices = [i if contains_read(i) else analyzer.simplify(i) for i in call.args[1:]]
        return call.args[0](*indices)

    return tvm_ffi.structural_map(expr, [(tvm.ir.Call, visit)])


def simplify_reads(expr, extents: Mapping[object, int]):
    """`expr` with its reads' indices simplified, each variable of `extents` in [0, extent): a layout
    rewrite's (cb * 16 + ci) // 16 becomes cb."""
    analyzer = Analyzer()
    for var, extent in extents.items():
        analyzer.bind(var, tvm.ir.Range(0, extent))

    def visit(call):
        if not call.op.same_as(TENSOR_LOAD):
            return call
        return call.args[0](*[analyzer.simplify(i) for i in call.args[1:]])

    return tvm_ffi.structural_map(expr, [(tvm.ir.Call, visit)])


def cost(expr) -> int:
    """Operations a body evaluates per point, weighted for recomputation.

    A cheap arithmetic, comparison or logic operation on data counts 1, an intrinsic call or a division
    EXPENSIVE_OP; choosing a branch (Select / if_then_else) counts 1. Index arithmetic -- inside a read's
    indices or in a condition that reads no data -- and casts count nothing: moving data is free to redo.
    A max, min or clamp spelled to keep NaN (souffle_py/frontend/ops/ieee.py) counts as the max it is.
    """
    return weighted_data_nodes(_as_min_max(expr), _weight)


def _as_min_max(expr):
    """`expr` with the NaN-keeping spellings of max and min written as Max and Min again: x < c ? c : x,
    x > c ? c : x, and (isnan(a) || a > b) ? a : b (and <)."""
    def visit(select):
        cond, chosen, other = select.condition, select.true_value, select.false_value
        if isinstance(cond, (pe.LT, pe.GT)) and _same(cond.a, other) and _same(cond.b, chosen):
            return (pe.Max if isinstance(cond, pe.LT) else pe.Min)(other, chosen)
        if (isinstance(cond, pe.Or) and isinstance(cond.b, (pe.LT, pe.GT)) and _is_nan_of(cond.a, chosen)
                and _same(cond.b.a, chosen) and _same(cond.b.b, other)):
            return (pe.Max if isinstance(cond.b, pe.GT) else pe.Min)(chosen, other)
        return select

    return tvm_ffi.structural_map(expr, [(pe.Select, visit)])


def _same(a, b) -> bool:
    if a.same_as(b):
        return True
    try:
        return tvm_ffi.structural_equal(a, b)
    except TypeError:  # reads of TE tensors have no structural equality: the same text is the same read
        return str(a) == str(b)


def _is_nan_of(expr, value) -> bool:
    return (isinstance(expr, tvm.ir.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == "tirx.isnan"
            and _same(expr.args[0], value))


def _weight(node) -> int:
    if isinstance(node, pe.Select) or (isinstance(node, tvm.ir.Call) and (node.op.same_as(IF_THEN_ELSE)
                                                                        or is_cheap_call(node))):
        return 1
    if isinstance(node, tvm.ir.Call) or (isinstance(node, _EXPENSIVE) and "float" in str(node.ty)):
        return EXPENSIVE_OP
    return 1 if isinstance(node, _CHEAP + _EXPENSIVE) else 0


def points(op: te.ComputeOp) -> int:
    """Iteration-domain size: output elements times reduction extent."""
    return math.prod(int(iv.dom.extent) for iv in list(op.axis) + list(op.reduce_axis))


def read_sites(op: te.ComputeOp) -> dict[tuple, int]:
    """tensor_key -> distinct index expressions the op reads it at (equal reads are one load once compiled)."""
    sites: dict[tuple, set] = {}
    for read in reads(op):
        sites.setdefault(tensor_key(read.tensor), set()).add(index_signature(read))
    return {key: len(found) for key, found in sites.items()}
