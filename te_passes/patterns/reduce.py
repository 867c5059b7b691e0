"""Row reductions recognised once: out[*rows] = sum / max / min over r of f(X[*rows, r]), the last axis of
X reduced (softmax's max and sum, layer norm's mean and variance, a global pool over a flattened map)."""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import te

from souffle_py.ir.exprs import uses
from souffle_py.ir.graph import tensor_loads
from te_passes.patterns.base import combiner_kind, indices, single_reduction


@dataclass(frozen=True)
class RowReduce:
    """A reduction over the last axis of each tensor it reads at its reduction variable."""

    op: te.ComputeOp
    kind: str  # sum, max or min
    reads: tuple  # the reads along the row (their last index is the reduction variable)
    keepdims: bool  # whether the output keeps the reduced axis (extent 1)

    @property
    def tensors(self) -> tuple:
        return tuple(read.args[0] for read in self.reads)

    @property
    def length(self) -> int:
        return int(self.op.reduce_axis[0].dom.extent)


def row_reduce(op) -> RowReduce | None:
    """`op` as a sum, max or min over one reduction axis that every read using it indexes last, at the
    output's leading indices; None when it is not one."""
    reduce = single_reduction(op)
    if reduce is None or len(op.reduce_axis) != 1 or op.num_outputs != 1:
        return None
    kind = combiner_kind(reduce)
    if kind is None:
        return None
    r = op.reduce_axis[0].var
    along = [ld for ld in tensor_loads(reduce.source[0]) if any(uses(x, r) for x in indices(ld))]
    if not along:
        return None
    outputs = [iv.var for iv in op.axis]
    keepdims = bool(outputs) and int(op.axis[-1].dom.extent) == 1 and all(
        len(indices(ld)) == len(outputs) for ld in along)
    rows = outputs[:-1] if keepdims else outputs
    for ld in along:
        idx = indices(ld)
        if (not isinstance(idx[-1], tvm.tirx.Var) or not idx[-1].same_as(r) or len(idx) != len(rows) + 1
                or not all(isinstance(x, tvm.tirx.Var) and x.same_as(v) for x, v in zip(idx[:-1], rows))):
            return None
    return RowReduce(op, kind, tuple(along), keepdims)
