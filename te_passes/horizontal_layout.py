"""Where the members of a horizontal group live in the combined TE (horizontal.py): concatenated along the
axis in which their shapes differ, along the axis their weights are indexed by (a GEMM's N, a conv's output
channels), along an axis of extent 1, or stacked on a new leading axis."""

from __future__ import annotations

from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import te, tirx

from souffle_py.ir.analysis.body import reads
from souffle_py.ir.exprs import substitute, uses
from souffle_py.ir.graph import tensor_key
from te_passes.weight_blocks import blocked_position


@dataclass
class Layout:
    """Where member k lives in the combined TE. `axis` is the concatenation axis of the combined TE (0 for a
    new leading axis); `offsets[k]` member k's start along it; `member` the member number as an expression
    of the combined axes when every member has the same extent there (else None)."""

    new_axis: bool
    axis: int
    offsets: list[int]
    extents: list[int]
    iter_vars: list
    member: object | None

    def local(self, k: int, op: te.ComputeOp) -> dict:
        """Member k's axis variables as expressions of the combined axes (handle -> expr)."""
        combined = [iv.var for iv in self.iter_vars]
        if self.new_axis:
            values = combined[1:]
        else:
            values = list(combined)
            a = values[self.axis]
            values[self.axis] = (a - self.member * self.extents[0] if self.member is not None
                                 else a - self.offsets[k])
        return {iv.var.__chandle__(): v for iv, v in zip(op.axis, values)}

    def region(self, k: int):
        """The predicate selecting member k's part, given that no earlier member's holds."""
        a = self.iter_vars[self.axis].var
        return a < self.offsets[k] + self.extents[k]

    def embed(self, k: int, indices: list) -> list:
        """The combined TE's indices of member k's element `indices`."""
        if self.new_axis:
            return [tirx.const(k, "int32"), *indices]
        out = list(indices)
        out[self.axis] = out[self.axis] + self.offsets[k]
        return out

    def isl_region(self, combined: str, k: int, member: str) -> str:
        """isl map from member k's part of the combined TE to the member's elements."""
        dims = [f"a{j}" for j in range(len(self.iter_vars))]
        bounds = [f"0 <= {d} < {int(iv.dom.extent)}" for d, iv in zip(dims, self.iter_vars)]
        if self.new_axis:
            target, cond = dims[1:], [f"a0 = {k}"]
        else:
            target = list(dims)
            target[self.axis] = f"{dims[self.axis]} - {self.offsets[k]}"
            cond = [f"{self.offsets[k]} <= {dims[self.axis]} < {self.offsets[k] + self.extents[k]}"]
        return f"{{ {combined}[{', '.join(dims)}] -> {member}[{', '.join(target)}] : {' and '.join(bounds + cond)} }}"


def choose_layout(ops, params) -> Layout:
    """The layout of the equal-kind TEs `ops` (`params`: the program's weight ops) in their combined TE."""
    shapes = [op_shape(op) for op in ops]
    differing = [d for d in range(len(shapes[0])) if len({s[d] for s in shapes}) > 1]
    axis = differing[0] if differing else _weight_axis(ops, params)
    if axis is None and 1 in shapes[0]:  # an axis of extent 1 concatenates like a new one, one rank lower
        axis = shapes[0].index(1)
    n = len(ops)
    first = ops[0].axis
    if axis is None:  # a new leading axis: member k is the slice k
        iter_vars = [iter_var("g", n)] + [iter_var(iv.var.name, int(iv.dom.extent)) for iv in first]
        return Layout(True, 0, list(range(n)), [1] * n, iter_vars, iter_vars[0].var)
    extents = [s[axis] for s in shapes]
    offsets = [sum(extents[:k]) for k in range(n)]
    iter_vars = [iter_var(iv.var.name, sum(extents) if d == axis else int(iv.dom.extent))
                 for d, iv in enumerate(first)]
    member = None if differing else tirx.floordiv(iter_vars[axis].var, extents[0])
    return Layout(False, axis, offsets, extents, iter_vars, member)


def _weight_axis(ops, params) -> int | None:
    """An axis d such that some weight every member reads from a different param is indexed by exactly
    axis d at one position of the same extent (a GEMM's N), or in blocks of it (a conv's output channels,
    W[f // B, c, r, s, f % B]) where the members read the same data at the same elements (equal convs
    of one input: Inception-v3's three 768 -> 192 1x1 convs, 2.32 -> 1.84 ms; stacked on a new axis
    they kept 16-channel weight blocks and a member axis the conv's 32-channel tiles do not take).
    Concatenating along d concatenates them (re-blocked: weight_blocks.py). Reductions whose members read
    different data stack instead: concatenated, their input would depend on the output channel, a gather
    per vector lane and multiply-add (MixNet-s's split-channel convs 6.9 -> 10.6 ms; Res2Net's seven 3x3
    convs over 28-channel slices, 6 GFLOP/s). Elementwise members (a BN + ReLU per branch) still
    concatenate: one choice per element."""
    per_member = [[r for r in reads(op) if r.tensor.op in params] for op in ops]
    if len({len(p) for p in per_member}) != 1:
        return None
    for column in zip(*per_member):
        if len({tensor_key(r.tensor) for r in column}) < len(column):
            continue
        for d in range(len(ops[0].axis)):
            if (all(_concatenates(r, op.axis[d]) for r, op in zip(column, ops)) or all(
                    blocked_position(r.indices, op.axis[d].var, r.tensor.shape) is not None
                    for r, op in zip(column, ops))) and (not ops[0].reduce_axis or _same_data_reads(ops, params, d)):
                return d
    return None


def _same_data_reads(ops, params, d: int) -> bool:
    """Whether every member reads the same tensors other than params at the same indices (its own loop
    variables taken for the first member's), none of them along axis d."""
    first = ops[0]
    data = [[r for r in reads(op) if r.tensor.op not in params] for op in ops]
    if not data[0] or len({len(r) for r in data}) != 1:
        return False
    along = first.axis[d].var
    for op, member in zip(ops, data):
        names = {iv.var.__chandle__(): f.var for iv, f in zip(list(op.axis) + list(op.reduce_axis),
                                                               list(first.axis) + list(first.reduce_axis))}
        for read, read0 in zip(member, data[0]):
            indices = [substitute(i, names) for i in read.indices]
            if (tensor_key(read.tensor) != tensor_key(read0.tensor) or any(uses(i, along) for i in indices)
                    or not all(tvm_ffi.structural_equal(a, b) for a, b in zip(indices, read0.indices))):
                return False
    return True


def iter_var(name: str, extent: int):
    return tirx.IterVar(tvm.ir.Range(0, extent), tvm.ir.Var(name, "int32"), 0, "")


def _concatenates(read, axis) -> bool:
    """Whether `read` indexes its tensor by exactly the iteration variable `axis` at a position of the same
    extent."""
    position = position_of_axis_var(read.indices, axis.var)
    return position is not None and int(read.tensor.shape[position]) == int(axis.dom.extent)


def position_of_axis_var(indices, var) -> int | None:
    """The one index position that is exactly `var`, or None."""
    found = [p for p, i in enumerate(indices) if isinstance(i, tvm.ir.Var) and i.same_as(var)]
    return found[0] if len(found) == 1 else None


def op_shape(op) -> tuple[int, ...]:
    return tuple(int(iv.dom.extent) for iv in op.axis)
