"""Graph utilities over TE DAGs: ordering, use lists and rebuilding a compute op over new inputs.

A TE read is a `tvm.ir.Call` to `te.tensor_load` with args [tensor, *indices]; rebuilding an op with some
of its reads redirected is the primitive that isolation (one kernel per TE) and the rewrites are built on.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping

import tvm
import tvm_ffi
from tvm import te


TENSOR_LOAD = tvm.ir.Op.get("te.tensor_load")


def compute_ops(outputs: Iterable[te.Tensor], stop: Iterable[te.Operation] = ()) -> list[te.ComputeOp]:
    """All compute ops reachable from `outputs` without passing through `stop`, producers first.

    A deterministic iterative post-order DFS (models have thousands of TEs: no recursion).
    """
    order: list[te.ComputeOp] = []
    seen: set = set(stop)
    for out in outputs:
        stack = [(out.op, False)]
        while stack:
            op, expanded = stack.pop()
            if expanded:
                order.append(op)
                continue
            if op in seen or not isinstance(op, te.ComputeOp):
                continue
            seen.add(op)
            stack.append((op, True))
            for t in reversed(list(op.input_tensors)):
                if t.op not in seen:
                    stack.append((t.op, False))
    return order


def placeholders(outputs: Iterable[te.Tensor]) -> list[te.Tensor]:
    """The placeholder tensors the DAG reads, in first-use order."""
    found, seen = [], set()
    for op in compute_ops(outputs):
        for t in op.input_tensors:
            if isinstance(t.op, te.PlaceholderOp) and t.op not in seen:
                seen.add(t.op)
                found.append(t)
    for out in outputs:
        if isinstance(out.op, te.PlaceholderOp) and out.op not in seen:
            seen.add(out.op)
            found.append(out)
    return found


def consumers(ops: Iterable[te.ComputeOp]) -> dict[te.Operation, list[te.ComputeOp]]:
    """Producer op -> compute ops reading it (each consumer listed once)."""
    uses: dict[te.Operation, list[te.ComputeOp]] = {}
    for op in ops:
        for producer in {t.op for t in op.input_tensors}:
            uses.setdefault(producer, []).append(op)
    return uses


def tensor_loads(expr) -> list[tvm.ir.Call]:
    """Every te.tensor_load call inside an expression, in visiting order."""
    loads = []

    def visit(call):
        if call.op.same_as(TENSOR_LOAD):
            loads.append(call)

    tvm_ffi.structural_walk(expr, [(tvm.ir.Call, visit)])
    return loads


def map_loads(expr, rewrite: Callable[[te.Tensor, list], tvm.ir.PrimExpr | None]):
    """Return `expr` with each read T[idx] replaced by rewrite(T, idx) where that is not None."""

    def visit(call):
        if call.op.same_as(TENSOR_LOAD):
            new = rewrite(call.args[0], list(call.args[1:]))
            if new is not None:
                return new
        return call

    return tvm_ffi.structural_map(expr, [(tvm.ir.Call, visit)])


def tensor_key(tensor: te.Tensor) -> tuple[te.Operation, int]:
    """A dict key for a tensor (te.Tensor's own == refuses rank-0 tensors)."""
    return (tensor.op, int(tensor.value_index))


def read_through(tensor_map: Mapping[tuple, object]) -> Callable[[te.Tensor, list], tvm.ir.PrimExpr | None]:
    """A map_loads rewrite reading tensor_map[tensor_key(T)] (a tensor or an indices -> read callable)
    wherever T is read; other reads unchanged."""
    def redirect(tensor, indices):
        new = tensor_map.get(tensor_key(tensor))
        return None if new is None else new(*indices)
    return redirect


def rebuild(op: te.ComputeOp, tensor_map: Mapping[tuple, te.Tensor], name: str | None = None,
            attrs=None) -> te.ComputeOp:
    """A copy of `op` reading tensor_map[tensor_key(T)] wherever it read T (same shapes required); attrs
    replace op.attrs when given."""

    body = [map_loads(b, read_through(tensor_map)) for b in op.body]
    return te.ComputeOp(name or op.name, op.tag, op.attrs if attrs is None else attrs, op.axis, op.reduce_axis,
                        body)


def with_reduce_source(op: te.ComputeOp, source, reduce_axis=None) -> te.ComputeOp:
    """`op` (a single reduction) summing `source` instead, over `reduce_axis` (its own when None)."""
    reduce = op.body[0]
    axis = list(op.reduce_axis if reduce_axis is None else reduce_axis)
    body = tvm.tirx.Reduce(reduce.combiner, [source], axis, reduce.condition, reduce.value_index, reduce.init)
    return te.ComputeOp(op.name, op.tag, op.attrs, op.axis, axis, [body])


def rebuild_reading(op: te.ComputeOp, tensor_map: Mapping[tuple, object], new_of: dict) -> te.ComputeOp:
    """`op` rebuilt over `tensor_map` if it reads a mapped tensor (its outputs then recorded in `new_of`,
    old tensor key -> new tensor), else `op`: the step of a pass's topological sweep over a program."""
    if not any(tensor_key(t) in tensor_map for t in op.input_tensors):
        return op
    new = rebuild(op, tensor_map)  # entries are tensors or (indices -> read) callables alike
    for i in range(op.num_outputs):
        new_of[tensor_key(op.output(i))] = new.output(i)
    return new


def sweep(stages, rewrite: Callable) -> tuple[dict, int]:
    """The sweep every rewriting pass makes: the TEs `stages`, producers first, each given to
    `rewrite(op, reads)`, which returns None to keep the TE (rebuilt over the tensors rewritten before it,
    if it reads one), the TE replacing it element for element, or (new TE, reader) where reader(*indices)
    reads the old tensor's element from the new one (a layout change). `reads` maps old tensor keys to what
    now stands for them, to rebuild `op`'s own reads with. Returns (new_of: old tensor key -> new tensor,
    for TEProgram.rebuilt; how many TEs `rewrite` replaced)."""
    reads: dict[tuple, object] = {}
    new_of: dict[tuple, te.Tensor] = {}
    replaced = 0
    for op in stages:
        found = rewrite(op, reads)
        new, reader = found if isinstance(found, tuple) else (found, None)
        replaced += new is not None
        if new is None:
            new = rebuild_reading(op, reads, {})
            if new is op:
                continue
        for i in range(op.num_outputs):
            key = tensor_key(op.output(i))
            new_of[key] = new.output(i)
            reads[key] = new.output(i) if reader is None else reader
    return new_of, replaced


def isolate(op: te.ComputeOp, input_names: Callable[[int], str] = lambda i: f"in{i}",
            name: str | None = None) -> tuple[list[te.Tensor], list[te.Tensor]]:
    """The op alone: fresh placeholders for each tensor it reads, and its outputs rebuilt over them.

    Used to give every TE its own kernel; `op.input_tensors` order decides the placeholder order.
    """
    inputs = list(op.input_tensors)
    fresh = [te.placeholder(t.shape, t.dtype, name=input_names(i)) for i, t in enumerate(inputs)]
    new_op = rebuild(op, {tensor_key(t): f for t, f in zip(inputs, fresh)}, name=name)
    return fresh, [new_op.output(i) for i in range(new_op.num_outputs)]



def sweep_bodies(stages, rewrite_expr: Callable) -> tuple[dict, int]:
    """`sweep` with each TE's body expressions mapped by `rewrite_expr` (a rewrite inside expressions: the
    int8 fold, the ratio form); a TE is replaced only where one of its expressions changed."""
    def rewrite(op, reads):
        current = rebuild_reading(op, reads, {})
        body = [rewrite_expr(b) for b in current.body]
        if all(new.same_as(old) for new, old in zip(body, current.body)):
            return None
        return te.ComputeOp(current.name, current.tag, current.attrs, current.axis, current.reduce_axis, body)

    return sweep(stages, rewrite)
