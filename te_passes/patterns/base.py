"""The vocabulary the patterns share: a read's indices, the named layouts a read's rank stands for, and a
reduction over a product of reads.

Why named layouts: passes used to tell a map from a weight by how many indices a read has (`len(ld.args) ==
5`); the rank is still what tells them apart, but the name says which layout a pass means (NCHW map, blocked
OIHWo weight) and is spelled in one place.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import te

from souffle_py.ir.graph import tensor_loads

# Ranks of the layouts the layout passes produce (maps and weights; `o` is a block of
# output channels, `c` a block of input channels, G the leading branch axis of horizontal.py's stacks).
LAYOUT_RANKS = {
    "NCW": 3, "NCHW": 4, "NCHWc": 5,  # maps: 1-D, 2-D, 2-D in channel blocks
    "OIWo": 4, "OIHWo": 5, "GOIHWo": 6,  # conv weights blocked over output channels; stacked per branch
}
MAP_LAYOUTS = ("NCW", "NCHW", "NCHWc")


def indices(load) -> list:
    """The indices of a read T[i, j, ...] (a te.tensor_load call)."""
    return list(load.args[1:])


def rank(load) -> int:
    """How many indices a read has."""
    return len(load.args) - 1


def in_layout(load, layout: str) -> bool:
    """Whether the read `load` indexes a tensor of `layout`'s rank (LAYOUT_RANKS)."""
    return rank(load) == LAYOUT_RANKS[layout]


def is_map(op, layout: str = "NCHW") -> bool:
    """Whether the compute op `op` has an output of `layout`'s rank (its axes: n, c, h, w for NCHW)."""
    return isinstance(op, te.ComputeOp) and len(op.axis) == LAYOUT_RANKS[layout]


def has_rank(tensor: te.Tensor, layout: str) -> bool:
    """Whether `tensor` has `layout`'s rank."""
    return len(tensor.shape) == LAYOUT_RANKS[layout]


@dataclass(frozen=True)
class ProductReduction:
    """A single reduction over a product: out[axes] = reduce over reduce_axis of a * b. `loads` are the
    reads inside the product in visiting order (a factor may be a composed expression of several)."""

    op: te.ComputeOp
    a: object
    b: object
    loads: tuple

    def of_layout(self, layout: str) -> list:
        """The product's reads of `layout`'s rank."""
        return [ld for ld in self.loads if in_layout(ld, layout)]


def single_reduction(op):
    """The Reduce body of `op` when it is a compute op with one body that is a reduction; else None."""
    if not isinstance(op, te.ComputeOp) or len(op.body) != 1 or not isinstance(op.body[0], tvm.tirx.Reduce):
        return None
    return op.body[0]


def product_reduction(op) -> ProductReduction | None:
    """`op` as a reduction over a product of two factors; None when it is not one."""
    reduce = single_reduction(op)
    if reduce is None or not isinstance(reduce.source[0], tvm.tirx.Mul):
        return None
    source = reduce.source[0]
    return ProductReduction(op, source.a, source.b, tuple(tensor_loads(source)))


def combiner_kind(reduce) -> str | None:
    """'sum', 'max' or 'min' for a single-value Reduce whose combiner is that; else None."""
    if len(reduce.combiner.result) != 1:
        return None
    result = reduce.combiner.result[0]
    for kind, node in (("sum", tvm.tirx.Add), ("max", tvm.tirx.Max), ("min", tvm.tirx.Min)):
        if isinstance(result, node):
            return kind
    return None
