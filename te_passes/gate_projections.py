"""An LSTM wavefront step's two gate projections of a layer as one reduction (GPU, merged kernels only).

After the wavefront (wavefront.py) a layer above the first reads, at every step, two per-step GEMVs: the
projection of the layer below's output (x_proj, a bridge) and of its own previous output (h_proj), and its
cell update reads each gate as `x_proj[.., e] + h_proj[.., e]`. This pass makes them one reduction over
the two inputs' concatenated terms, `gates[.., e]` (one projection's terms, then the other's): in a grid
kernel one warp reduction per output instead of two, over one weight row each of the two weights in turn
(adjacent lanes, adjacent elements), half the stages and shuffle rounds per wavefront step (the paper's
10-layer LSTM: 10 instead of 19), and the two sums of a gate added inside the reduction. Sums differ from
the two-GEMV form only in order. Layers whose cell reads the projections otherwise are left alone.
"""

from __future__ import annotations

import logging

import tvm
import tvm_ffi
from tvm import te, tirx

from souffle_py.program import TEProgram
from te_passes.exprs import substitute
from te_passes.graph import TENSOR_LOAD, rebuild_reading, tensor_key, tensor_loads
from te_passes.recurrence import member_of

log = logging.getLogger(__name__)


def combine_gate_projections(program: TEProgram) -> TEProgram:
    """`program` with each pair of a recurrence step's gate projections as one reduction."""
    consumers = program.consumers()
    plans, planned = {}, set()   # by op name (unique in a program)
    for op in program.stages:
        pair = None if op.name in planned else _pair(op, consumers)
        if pair is not None:
            planned.update(p.name for p in pair)
            plans.update({reader.name: pair for reader in consumers[op]})
    if not plans:
        return program
    new_of: dict[tuple, te.Tensor] = {}
    gates_of: dict[tuple, te.Tensor] = {}
    for op in program.stages:
        current = rebuild_reading(op, new_of, new_of)
        pair = plans.get(op.name)
        if pair is None:
            continue
        now = [new_of.get(tensor_key(p.output(0)), p.output(0)).op for p in pair]
        key = tuple(p.name for p in pair)
        if key not in gates_of:
            gates_of[key] = _gates(now)
        new_of[tensor_key(op.output(0))] = _reading_gates(current, now, gates_of[key]).output(0)
    log.info("%d recurrence steps' gate projection pairs as one reduction each", len(gates_of))
    return program.rebuilt(new_of)


def _pair(op, consumers):
    """(h_proj, x_proj) when `op` is one of two sums over one axis, members of one recurrence, of one
    shape, with the same readers, element-wise members that read them only as `x[.., e] + h[.., e]`."""
    if not _is_projection(op):
        return None
    readers = consumers.get(op, [])
    if not readers or any(r.reduce_axis or member_of(r) != member_of(op) for r in readers):
        return None
    partners = []
    for tensor in (t for reader in readers for t in reader.input_tensors):
        if not tensor.op.same_as(op) and _is_projection(tensor.op) and member_of(tensor.op) == member_of(op) \
                and [int(d) for d in tensor.shape] == [int(d) for d in op.output(0).shape] \
                and not any(tensor.op.same_as(p) for p in partners):
            partners.append(tensor.op)
    if len(partners) != 1 or {r.name for r in consumers.get(partners[0], [])} != {r.name for r in readers}:
        return None
    pair = (op, partners[0])
    return pair if all(_reads_only_summed(reader, pair) for reader in readers) else None


def _is_projection(op) -> bool:
    if not isinstance(op, te.ComputeOp) or len(op.reduce_axis) != 1 or op.num_outputs != 1 \
            or not isinstance(op.body[0], tirx.Reduce) or member_of(op) is None:
        return False
    reduce = op.body[0]
    identity = reduce.combiner.identity_element[0]
    return isinstance(reduce.combiner.result[0], tirx.Add) and isinstance(identity, (tirx.FloatImm, tirx.IntImm)) \
        and float(identity.value) == 0.0 and isinstance(reduce.condition, tirx.IntImm) \
        and int(reduce.condition.value) == 1


def _reads_only_summed(reader, pair) -> bool:
    """Every read of either projection in `reader` is a term of a sum with the other's read of the same
    element."""
    sums = []
    tvm_ffi.structural_walk(reader.body[0], [(tirx.Add, lambda node: sums.append(_summed_element(node, pair)))])
    loads = [ld for ld in tensor_loads(reader.body[0]) if any(ld.args[0].op.same_as(p) for p in pair)]
    paired = sum(1 for s in sums if s is not None)
    return paired > 0 and len(loads) == 2 * paired


def _summed_element(node, pair):
    """The indices both projections are read at, when `node` is their sum; else None."""
    if not isinstance(node, tirx.Add):
        return None
    a, b = node.a, node.b
    if not all(isinstance(x, tvm.ir.Call) and x.op.same_as(TENSOR_LOAD) for x in (a, b)):
        return None
    ops = (a.args[0].op, b.args[0].op)
    if not ((ops[0].same_as(pair[0]) and ops[1].same_as(pair[1])) or (ops[0].same_as(pair[1]) and ops[1].same_as(pair[0]))):
        return None
    same = len(a.args) == len(b.args) and all(tvm_ffi.structural_equal(x, y) for x, y in zip(a.args[1:], b.args[1:]))
    return list(a.args[1:]) if same else None


def _gates(pair) -> te.Tensor:
    """One reduction over both projections' terms, in turn."""
    first, second = pair
    extents = [int(p.reduce_axis[0].dom.extent) for p in pair]

    def body(*idx):
        k = te.reduce_axis((0, sum(extents)), name="k")
        terms = []
        for projection, start in zip(pair, (0, extents[0])):
            mapping = {iv.var.__chandle__(): value for iv, value in zip(projection.axis, idx)}
            mapping[projection.reduce_axis[0].var.__chandle__()] = k - start
            terms.append(substitute(projection.body[0].source[0], mapping))
        return te.sum(tirx.if_then_else(k < extents[0], terms[0], terms[1]), axis=k)

    return te.compute(first.output(0).shape, body, name=f"{first.name}_gates", attrs=first.attrs)


def _reading_gates(reader, pair, gates) -> te.ComputeOp:
    """`reader` reading gates[.., e] wherever it read x_proj[.., e] + h_proj[.., e]."""

    def replace(node):
        element = _summed_element(node, pair)
        return node if element is None else gates(*element)

    body = [tvm_ffi.structural_map(b, [(tirx.Add, replace)]) for b in reader.body]
    return te.ComputeOp(reader.name, reader.tag, reader.attrs, reader.axis, reader.reduce_axis, body)
