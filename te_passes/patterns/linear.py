"""Matrix products recognised once: out[*batch, i, j] = sum over k of A[.., i, k] * B[.., k, j], with the
operands' layouts and which side is a constant weight named.

A's layout is "MK" or "KM" (Gemm's transA); B's is "KN", "NK" (transB, a linear layer's weight) or
"packed", a weight stored in column panels [N / P, K, P] read at [j // P, k, j % P]. The leading indices of
a read are its batch indices; they must not use i, j or k (a broadcast batch index is a constant).
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import te

from souffle_py.ir.exprs import uses
from te_passes.patterns.base import indices, product_reduction


@dataclass(frozen=True)
class MatMul:
    """A matrix product TE (module docstring)."""

    op: te.ComputeOp
    a: object  # the read of A
    b: object  # the read of B
    a_layout: str  # MK or KM
    b_layout: str  # KN, NK or packed
    constant: str | None  # "a", "b" or None: the side that is a weight (B where both are)

    @property
    def batch(self) -> int:
        """How many leading output axes are batch axes."""
        return len(self.op.axis) - 2

    @property
    def a_batched(self) -> bool:
        return len(indices(self.a)) > 2

    @property
    def b_batched(self) -> bool:
        return len(indices(self.b)) > (3 if self.b_layout == "packed" else 2)

    @property
    def shape(self) -> tuple:
        """(M, N, K)."""
        return (int(self.op.axis[-2].dom.extent), int(self.op.axis[-1].dom.extent),
                int(self.op.reduce_axis[0].dom.extent))


def _same(index, var) -> bool:
    return isinstance(index, tvm.tirx.Var) and index.same_as(var)


def _a_layout(read, i, k) -> str | None:
    tail = indices(read)[-2:]
    if len(tail) == 2 and _same(tail[0], i) and _same(tail[1], k):
        return "MK"
    if len(tail) == 2 and _same(tail[0], k) and _same(tail[1], i):
        return "KM"
    return None


def _b_layout(read, j, k) -> str | None:
    idx = indices(read)
    if len(idx) >= 3 and _same(idx[-2], k):  # packed panels [.., j // P, k, j % P]
        panel = int(read.args[0].shape[-1])
        offset = tvm.sym.Analyzer().simplify(idx[-3] * panel + idx[-1] - j)
        if isinstance(offset, tvm.tirx.IntImm) and offset.value == 0 and not _same(idx[-1], j):
            return "packed"
    if len(idx) >= 2 and _same(idx[-2], k) and _same(idx[-1], j):
        return "KN"
    if len(idx) >= 2 and _same(idx[-2], j) and _same(idx[-1], k):
        return "NK"
    return None


def _placeholder(tensor: te.Tensor) -> bool:
    return isinstance(tensor.op, te.PlaceholderOp)


def matmul(op, is_weight=_placeholder) -> MatMul | None:
    """`op` as a matrix product over its last two axes and one reduction axis; None when it is not one.
    `is_weight(tensor)` tells a constant weight (a placeholder by default; a pass that has the program
    passes `lambda t: program.placeholder_kind(t) == "param"`)."""
    product = product_reduction(op)
    if product is None or len(product.loads) != 2 or len(op.reduce_axis) != 1 or len(op.axis) < 2:
        return None
    i, j, k = op.axis[-2].var, op.axis[-1].var, op.reduce_axis[0].var
    for a, b in (product.loads, product.loads[::-1]):
        a_layout, b_layout = _a_layout(a, i, k), _b_layout(b, j, k)
        if a_layout is None or b_layout is None:
            continue
        lead_a = indices(a)[:-2]
        lead_b = indices(b)[:-3 if b_layout == "packed" else -2]
        if any(uses(x, v) for x in lead_a + lead_b for v in (i, j, k)):
            return None
        constant = next((side for side, read in (("b", b), ("a", a)) if is_weight(read.args[0])), None)
        return MatMul(op, a, b, a_layout, b_layout, constant)
    return None


def gemm(op, is_weight=_placeholder) -> MatMul | None:
    """A matrix product whose B is not batched (one weight for every row: a linear layer, ONNX Gemm)."""
    found = matmul(op, is_weight)
    return found if found is not None and not found.b_batched else None


def batch_matmul(op, is_weight=_placeholder) -> MatMul | None:
    """A matrix product with a batch axis in both operands (attention's Q.K^T and P.V)."""
    found = matmul(op, is_weight)
    return found if found is not None and found.batch and found.a_batched and found.b_batched else None
