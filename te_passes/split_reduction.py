"""Split a reduction into partial reductions and a short final one (split-K), to spread few outputs with
long reductions over more threads.

Inside a grid-synchronized GPU kernel every stage runs one thread per output element (or one block per
64 x 64 output tile of a GEMM) with its reduction serial: BERT-base's layer-norm statistics are 128
outputs of 768 terms, so 128 threads of one SM walk 768 elements each while the other 131 SMs wait at the
next barrier; its second FFN GEMM is 24 tiles of depth 3072 on 24 SMs. Written as

    partial[..., s] = reduce_{kk} body(k = kk * S + s)        (S partial sums; k >= K adds the identity)
    out[...]        = reduce_s partial[..., s]

the partial stage has S times the threads (for a GEMM, S times the tiles: `partial[s, i, j]` over the
contiguous k-chunk s, which the grid kernel tiles like any GEMM), at the price of one more grid barrier
and S loads per output. Interleaved chunks (k = kk * S + s) make adjacent threads read adjacent elements;
a GEMM's chunks are contiguous so that its tiles stay plain GEMMs. The combiner is the reduction's own
(sum, max, min), so the result differs from the unsplit one only by the order of floating-point sums.

Which reductions to split, and into how many parts, is the target's call (`Split` per TE, decided by the
CUDA backend from its grid's tile and SM counts); this module only rewrites.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from tvm import te, tirx

from souffle_py.ir.program import TEProgram
from souffle_py.ir.exprs import substitute
from souffle_py.ir.graph import rebuild_reading, sweep

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Split:
    """How to split one reduction: into `parts` partial reductions, as contiguous chunks (a GEMM, whose
    partial stays a GEMM with the parts as its leading batch axis) or interleaved ones (trailing axis)."""

    parts: int
    contiguous: bool = False


def splittable(op: te.ComputeOp) -> bool:
    """One output, one reduction axis starting at 0, no initial value (each partial would add it again):
    the form `split_reductions` rewrites."""
    return (isinstance(op, te.ComputeOp) and op.num_outputs == 1 and len(op.reduce_axis) == 1
            and isinstance(op.body[0], tirx.Reduce) and len(op.body[0].source) == 1
            and not op.body[0].init and int(op.reduce_axis[0].dom.min) == 0)


def split_reductions(program: TEProgram, decide: Callable[[te.ComputeOp], Split | None]) -> TEProgram:
    """`program` with every reduction that `decide` returns a Split for rewritten as partial + final."""
    def rewrite(op, reads):
        split = decide(op) if splittable(op) else None
        if split is None or split.parts <= 1:
            return None
        return _split(rebuild_reading(op, reads, {}), split)

    new_of, count = sweep(program.stages, rewrite)
    if not count:
        return program
    log.info("split %d reductions into partial and final reductions", count)
    return program.rebuilt(new_of)


def guarded(reduce: tirx.Reduce, source, condition):
    """`source` where `condition` holds, else the combiner's identity (0 for a sum). A Reduce's own
    condition (te.sum's `where`) is not enough: TVM 0.27's te.create_prim_func drops it."""
    return tirx.if_then_else(condition, source, reduce.combiner.identity_element[0])


def _split(op: te.ComputeOp, split: Split) -> te.ComputeOp:
    reduce = op.body[0]
    k = op.reduce_axis[0]
    extent, parts = int(k.dom.extent), split.parts
    depth = -(-extent // parts)
    shape = [int(d) for d in op.output(0).shape]

    def partial_body(*indices):
        s, rest = (indices[0], indices[1:]) if split.contiguous else (indices[-1], indices[:-1])
        kk = te.reduce_axis((0, depth), name=f"{k.var.name}_in")
        index = s * depth + kk.var if split.contiguous else kk.var * parts + s
        mapping = {iv.var.__chandle__(): value for iv, value in zip(op.axis, rest)}
        mapping[k.var.__chandle__()] = index
        source = substitute(reduce.source[0], mapping)
        if depth * parts != extent:
            source = guarded(reduce, source, index < extent)
        return tirx.Reduce(reduce.combiner, [source], [kk], substitute(reduce.condition, mapping), 0,
                           reduce.init)

    partial_shape = [parts, *shape] if split.contiguous else [*shape, parts]
    partial = te.compute(partial_shape, partial_body, name=f"{op.name}_partial", tag=op.tag)

    def final_body(*indices):
        s = te.reduce_axis((0, parts), name="part")
        read = partial(s.var, *indices) if split.contiguous else partial(*indices, s.var)
        return tirx.Reduce(reduce.combiner, [read], [s], tirx.const(True, "bool"), 0, reduce.init)

    return te.compute(shape, final_body, name=op.name, tag=op.tag, attrs=op.attrs).op
