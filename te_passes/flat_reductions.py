"""Reductions over a flattened axis split back into its factors (CPU backend).

ONNX exports often reduce a map through a reshape: GroupNorm with one group is InstanceNormalization over
x.reshape(N, 1, C * H * W), so after the vertical pass composes the reshape, its mean and variance sum
one axis r of C * H * W terms that reads X[n, r // (H * W), r % (H * W) // W, r % W] and a per-channel
bias b[r // (H * W)]. Along r the bias read is neither contiguous nor the same for a vector's lanes as
far as an index analysis sees, so the sum ran as one scalar chain (PoolFormer-S12: 0.3 ms per statistic,
24 of them). Summed over r = rc * K + rk instead (K the largest constant r is divided by, a divisor of
its extent), the bias is b[rc], invariant along rk, and X's read is contiguous along rk: the reduction
schedule's vector partial sums apply (schedule/default.py). Values are unchanged up to the order of the
float additions, as for any vectorized sum.
"""

from __future__ import annotations

import logging

import tvm
import tvm_ffi
from tvm import te

from souffle_py.ir.program import TEProgram
from souffle_py.ir.exprs import simplify_indices, substitute, uses
from souffle_py.ir.graph import rebuild_reading, sweep, tensor_loads, with_reduce_source
from souffle_py.ir.marks import member_of

log = logging.getLogger(__name__)

MIN_TERMS = 1024  # shorter sums are not worth a second reduction axis


def split_flat_reductions(program: TEProgram) -> TEProgram:
    """`program` with each single-axis sum whose body divides its axis by a constant K dividing the extent
    (and not only by smaller ones) summed over two axes (module docstring); contractions are left alone;
    unchanged when none qualifies."""
    def rewrite(op, reads):
        factor = _flat_factor(op)
        if factor is None:
            return None
        return _split(rebuild_reading(op, reads, {}), factor)  # over what earlier rewrites replaced

    new_of, replaced = sweep(program.stages, rewrite)
    if not replaced:
        return program
    log.info("%d sums over a flattened axis reduce over its factors", replaced)
    return program.rebuilt(new_of)


def _flat_factor(op) -> int | None:
    """The largest constant K with r // K or r % K in `op`'s body (r its only reduction axis), K dividing
    r's extent, 1 < K < extent; None where there is none or `op` is no plain sum."""
    if (not isinstance(op, te.ComputeOp) or op.num_outputs != 1 or len(op.reduce_axis) != 1
            or member_of(op) is not None or not isinstance(op.body[0], tvm.tirx.Reduce)):
        return None
    r = op.reduce_axis[0]
    extent = int(r.dom.extent)
    if extent < MIN_TERMS:
        return None
    factors = []

    def visit(node):
        if isinstance(node, (tvm.tirx.FloorDiv, tvm.tirx.FloorMod)) and node.a.same_as(r.var) \
                and isinstance(node.b, tvm.tirx.IntImm):
            factors.append(int(node.b.value))
    tvm_ffi.structural_walk(op.body[0].source[0], [(tvm.tirx.FloorDiv, visit), (tvm.tirx.FloorMod, visit)])
    factors = [k for k in factors if 1 < k < extent and extent % k == 0]
    if not factors or _is_contraction(op.body[0].source[0], r.var):
        return None
    return max(factors)


def _is_contraction(source, var) -> bool:
    """A product of reads of different tensors both indexed by `var` (a GEMM or conv's channel sum, left to
    their own schedules); a variance's (x - m) * (x - m) reads the same tensor on both sides."""
    if not isinstance(source, tvm.tirx.Mul):
        return False

    def read(expr):
        return {ld.args[0].op for ld in tensor_loads(expr) if any(uses(i, var) for i in ld.args[1:])}
    left, right = read(source.a), read(source.b)
    return bool(left) and bool(right) and not (left & right)


def _split(op, factor: int) -> te.ComputeOp:
    """`op` summed over (rc, rk), r = rc * factor + rk, its reads' indices simplified."""
    r = op.reduce_axis[0]
    rc = te.reduce_axis((0, int(r.dom.extent) // factor), name=f"{r.var.name}_outer")
    rk = te.reduce_axis((0, factor), name=f"{r.var.name}_inner")
    source = substitute(op.body[0].source[0], {r.var.__chandle__(): rc.var * factor + rk.var})
    return with_reduce_source(op, simplify_indices(source, [*op.axis, rc, rk]), [rc, rk])
