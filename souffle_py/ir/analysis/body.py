"""Walks over a TE's body shared by both analysis levels: its reads with the guards they sit under, the
variables an index uses, and the arithmetic performed per iteration point.

Guards matter because padding, concatenation and step selection (the LSTM's Y) read a tensor only where a
predicate holds: in `if_then_else(c, A[..], B[..])` the value depends on A only where c holds. The walks are
iterative (an unrolled LSTM nests a hundred Selects) and never descend into a read's producer.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import te
from tvm.ir.prim import expr as pe

from souffle_py.ir.graph import TENSOR_LOAD, tensor_key, tensor_loads

IF_THEN_ELSE = tvm.ir.Op.get("prim.if_then_else")
_LEAVES = (pe.Var, pe.IntImm, pe.FloatImm, pe.Constant)
# Nodes that are operations on values (an if_then_else / Select / Cast / Let moves a value, it computes none).
_OPERATIONS = (pe.BinaryOpExpr, pe.CmpExpr, pe.LogicalExpr, pe.Not, pe.BitwiseNot)


@dataclass(frozen=True, eq=False)
class Guard:
    """A branch taken on the way to a read: `cond` evaluated to `holds`, inside the enclosing `parent` guard.

    A linked list, so reads in one branch share their prefix (and the analysis converts each prefix once).
    """

    parent: "Guard | None"
    cond: pe.Expr
    holds: bool


@dataclass(frozen=True, eq=False)
class Read:
    """One tensor read `tensor[indices]` of a TE body, performed where `guard` holds (None: everywhere)."""

    tensor: te.Tensor
    indices: tuple
    guard: Guard | None


def children(expr) -> tuple:
    """The sub-expressions of a node (a read's tensor is not one: the walk stays inside the TE)."""
    if isinstance(expr, _LEAVES):
        return ()
    if isinstance(expr, (pe.Not, pe.BitwiseNot)):  # before LogicalExpr: Not is one, with a single operand
        return (expr.a,)
    if isinstance(expr, (pe.BinaryOpExpr, pe.CmpExpr, pe.LogicalExpr)):
        return (expr.a, expr.b)
    if isinstance(expr, pe.Cast):
        return (expr.value,)
    if isinstance(expr, pe.Select):
        return (expr.condition, expr.true_value, expr.false_value)
    if isinstance(expr, tvm.ir.Call):
        return tuple(expr.args[1:]) if expr.op.same_as(TENSOR_LOAD) else tuple(expr.args)
    if isinstance(expr, pe.Let):
        return (expr.value, expr.body)
    if isinstance(expr, pe.Broadcast):
        return (expr.value,)
    if isinstance(expr, pe.Ramp):
        return (expr.base, expr.stride)
    return tuple(tensor_loads(expr))  # an unexpected node kind: keep at least the reads below it


def is_read(expr) -> bool:
    return isinstance(expr, tvm.ir.Call) and expr.op.same_as(TENSOR_LOAD)


def _branches(expr):
    """(condition, value if true, value if false) of a Select or if_then_else node, else None."""
    if isinstance(expr, pe.Select):
        return expr.condition, expr.true_value, expr.false_value
    if isinstance(expr, tvm.ir.Call) and expr.op.same_as(IF_THEN_ELSE):
        return tuple(expr.args)
    return None


def value_roots(op: te.ComputeOp) -> list[tuple[object, Guard | None]]:
    """The expressions a TE evaluates at each iteration point, each with the guard it is evaluated under.

    A reduction's sources are evaluated only where its `condition` holds; its outputs share one source list
    (and its `init` values, when given, count as evaluated at every point: a slight over-count of work).
    """
    first = op.body[0]
    if isinstance(first, tvm.tirx.Reduce):
        cond = first.condition
        always = isinstance(cond, pe.IntImm) and bool(cond.value)
        guard = None if always else Guard(None, cond, True)
        return ([(cond, None)] * (not always) + [(s, guard) for s in first.source]
                + [(i, None) for i in first.init])
    return [(b, None) for b in op.body]


def reads(op: te.ComputeOp) -> list[Read]:
    """Every tensor read of the TE in visiting order, including reads nested in another read's indices."""
    found: list[Read] = []
    stack = list(reversed(value_roots(op)))
    while stack:
        expr, guard = stack.pop()
        if is_read(expr):
            found.append(Read(expr.args[0], tuple(expr.args[1:]), guard))
        branches = _branches(expr)
        if branches is not None:
            cond, yes, no = branches
            stack += [(no, Guard(guard, cond, False)), (yes, Guard(guard, cond, True)), (cond, guard)]
            continue
        stack += [(child, guard) for child in reversed(children(expr))]
    return found


def variables(exprs) -> set[int]:
    """Handles of the variables the expressions use (the walk identifies a Var by its node, not its name)."""
    used: set[int] = set()
    stack = list(exprs)
    while stack:
        expr = stack.pop()
        if isinstance(expr, pe.Var):
            used.add(expr.__chandle__())
        stack += children(expr)
    return used


def contains_read(expr) -> bool:
    """Whether the value of `expr` depends on tensor data (as a Gather index does)."""
    stack = [expr]
    while stack:
        node = stack.pop()
        if is_read(node):
            return True
        stack += children(node)
    return False


def operations(expr, data_vars: frozenset[int] = frozenset()) -> int:
    """Operations on data values in `expr`: nodes of _OPERATIONS and intrinsic calls (exp, sqrt, ...) with a
    tensor read (or one of `data_vars`) below them. Index arithmetic inside a read's indices is not counted:
    it is address computation, not work on the tensor's elements."""
    return weighted_data_nodes(expr, _operation_weight, data_vars)


def _operation_weight(node) -> int:
    if _is_bit_conversion(node):
        return 0
    return int(isinstance(node, _OPERATIONS) or (isinstance(node, tvm.ir.Call) and _branches(node) is None))


_REINTERPRET = tvm.ir.Op.get("tirx.reinterpret")


def _is_bit_conversion(node) -> bool:
    """A bit cast or unsigned bit arithmetic: how bfloat16 values are rounded and widened (te_passes/
    precision.py), storage conversion rather than work on the data."""
    if isinstance(node, tvm.ir.Call):
        return node.op.same_as(_REINTERPRET)
    return isinstance(node, pe.BinaryOpExpr) and str(getattr(node, "ty", "")).startswith("uint")


def weighted_data_nodes(expr, weight, data_vars: frozenset[int] = frozenset()) -> int:
    """The sum of weight(node) over the nodes of `expr` that have data (a tensor read, or one of
    `data_vars`) below them; a read's own indices are not visited. Iterative post-order: bodies can be deep
    (the LSTM's select chains)."""
    results: list[tuple[int, bool]] = []  # (sum, depends on data) per finished node
    stack = [(expr, False)]
    while stack:
        node, expanded = stack.pop()
        if is_read(node) or (isinstance(node, pe.Var) and node.__chandle__() in data_vars):
            results.append((0, True))
            continue
        kids = children(node)
        if not expanded and kids:
            stack.append((node, True))
            stack += [(k, False) for k in kids]
            continue
        done = results[len(results) - len(kids):] if kids else []
        del results[len(results) - len(kids):]
        total = sum(o for o, _ in done)
        data = any(d for _, d in done)
        results.append((total + (weight(node) if data else 0), data))
    return results[0][0]


def operations_per_point(op: te.ComputeOp) -> int:
    """Operations the TE performs at each point of its iteration domain (a reduction's combiner included)."""
    first = op.body[0]
    total = sum(operations(root) for root, _ in value_roots(op))
    if isinstance(first, tvm.tirx.Reduce):
        combiner = first.combiner
        data = frozenset(v.__chandle__() for v in list(combiner.lhs) + list(combiner.rhs))
        total += sum(operations(r, data) for r in combiner.result)
    return total


def reads_by_tensor(op: te.ComputeOp, op_reads: list[Read] | None = None) -> dict[tuple, list[Read]]:
    """tensor_key -> the reads of that tensor (op_reads, or all the op's reads), in op.input_tensors order."""
    grouped: dict[tuple, list[Read]] = {tensor_key(t): [] for t in op.input_tensors}
    for read in reads(op) if op_reads is None else op_reads:
        grouped.setdefault(tensor_key(read.tensor), []).append(read)
    return grouped


def index_signature(read: Read) -> tuple:
    """A key equal for two reads of the same tensor at structurally equal indices."""
    return (tensor_key(read.tensor),) + tuple(expr_signature(i) for i in read.indices)


def expr_signature(expr):
    """A hashable key equal for structurally equal expressions. TVM cannot hash a tensor read (its
    te.Tensor argument), which a data-dependent index such as a Gather's holds: those reads are keyed by
    tensor and index signatures, the rest by TVM's structural hash."""
    if not contains_read(expr):
        return tvm_ffi.structural_hash(expr)
    if is_read(expr):
        return ("read", tensor_key(expr.args[0])) + tuple(expr_signature(i) for i in expr.args[1:])
    op = expr.op.name if isinstance(expr, tvm.ir.Call) and hasattr(expr.op, "name") else ""
    dtype = str(getattr(expr, "dtype", getattr(expr, "ty", "")))
    return (type(expr).__name__, op, dtype) + tuple(expr_signature(c) for c in children(expr))
