"""An LSTM wavefront step's gate projections: one reduction per layer, a unit's gates and cell in one warp (GPU).

After the wavefront (wavefront.py) a layer above the first reads, at every step, two per-step GEMVs: the
projection of the layer below's output (x_proj, a bridge) and of its own previous output (h_proj), and its
cell update reads each gate as `x_proj[.., e] + h_proj[.., e]`. This pass makes them one reduction over
the two inputs' concatenated terms, `gates[.., e]` (one projection's terms, then the other's): in a grid
kernel one warp reduction per output instead of two, over one weight row each of the two weights in turn
(adjacent lanes, adjacent elements), half the stages and shuffle rounds per wavefront step (the paper's
10-layer LSTM: 10 instead of 19), and the two sums of a gate added inside the reduction. Sums differ from
the two-GEMV form only in order. Layers whose cell reads the projections otherwise are left alone.

`mark_gate_cells` then marks each step's gate projection (its last axis G blocks of H units) and the cell
updates that read only their own unit's gates: the grid kernel computes a unit's G gates in one warp, in
turn, and maps the cell updates a warp per unit, so that each reads only what its own warp's lane 0
wrote (a __syncwarp, not a grid barrier): one grid barrier per wavefront step, at its end.
"""

from __future__ import annotations

import logging

import tvm
import tvm_ffi
from tvm import te, tirx

from souffle_py.ir.program import TEProgram
from souffle_py.ir.exprs import substitute
from souffle_py.ir.graph import TENSOR_LOAD, map_loads, read_through, rebuild_reading, sweep, tensor_key, tensor_loads
from souffle_py.ir.marks import GATE_BLOCKS, GATE_CELL, member_of

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


MAX_GATES = 4


def mark_gate_cells(program: TEProgram) -> TEProgram:
    """`program` with each recurrence step's gate projection (a sum whose last axis is G blocks of H units,
    G <= MAX_GATES) and its readers marked, when every reader is an element-wise member of the same
    recurrence over [.., H] that reads the projection only at its own unit, `proj[.., g * H + u]`: a grid
    kernel (backends/cuda/grid.py) then computes a unit's G gates in one warp and the cell update right
    after them in that warp, behind a __syncwarp instead of a grid barrier."""
    consumers = program.consumers()
    marks: dict[str, dict] = {}
    for op in program.stages:
        readers = consumers.get(op, [])
        blocks = _gate_blocks(op, readers)
        if blocks:
            marks[op.name] = {GATE_BLOCKS: blocks}
            for reader in readers:
                marks[reader.name] = {GATE_CELL: 1}
    if not marks:
        return program
    new_of: dict[tuple, te.Tensor] = {}
    for op in program.stages:
        current = rebuild_reading(op, new_of, new_of)
        if op.name in marks:
            attrs = {**dict(current.attrs or {}), **marks[op.name]}
            new = te.ComputeOp(current.name, current.tag, attrs, current.axis, current.reduce_axis, current.body)
            new_of[tensor_key(op.output(0))] = new.output(0)
    return program.rebuilt(new_of)


def _gate_blocks(op, readers) -> int:
    """G when `op` is a gate projection that mark_gate_cells can mark; else 0."""
    if not _is_projection(op) or not readers:
        return 0
    width = int(op.output(0).shape[-1])
    units = {int(r.output(0).shape[-1]) for r in readers}
    if len(units) != 1:
        return 0
    (unit,) = units
    if width % unit or not 1 < width // unit <= MAX_GATES:
        return 0
    for reader in readers:
        if reader.reduce_axis or member_of(reader) != member_of(op) or len(reader.axis) != len(op.axis):
            return 0
        for load in tensor_loads(reader.body[0]):
            if load.args[0].op.same_as(op) and not _at_own_unit(list(load.args[1:]), reader, unit):
                return 0
    return width // unit


def _at_own_unit(indices, reader, unit: int) -> bool:
    """indices == (reader's axes but the last, its last axis + g * unit) for a constant g."""
    *outer, last = indices
    axes = [iv.var for iv in reader.axis]
    if not all(tvm_ffi.structural_equal(i, a) or _is_zero_extent_axis(i, iv)
               for i, a, iv in zip(outer, axes, reader.axis)):
        return False
    offset = tvm.sym.Analyzer().simplify(last - axes[-1])
    return isinstance(offset, tirx.IntImm) and int(offset.value) % unit == 0


def _is_zero_extent_axis(index, iv) -> bool:
    """A constant 0 read along an axis of extent 1 (the batch of one)."""
    return isinstance(index, tirx.IntImm) and int(index.value) == 0 and int(iv.dom.extent) == 1


def group_gate_projections(program: TEProgram, group_units) -> TEProgram:
    """`program` with each marked gate projection (`mark_gate_cells`; G blocks of H units) stored by groups
    of U = group_units(H, G) units, [.., H / U, G, U]: the CPU computes a group's G gates in one register
    tile and the group's cell updates right after them on the same thread (schedule/gates.py). Readers
    read proj[.., g * H + u] at [.., u // U, g, u % U]. Projections without such a U are left alone."""
    def rewrite(op, reads):
        gates = int(op.attrs[GATE_BLOCKS]) if op.attrs is not None and GATE_BLOCKS in op.attrs else 0
        if not gates:
            return None
        width = int(op.output(0).shape[-1])
        units = width // gates
        per_group = group_units(units, gates)
        if not per_group:
            return None
        handles = [iv.var.__chandle__() for iv in op.axis]
        body = map_loads(op.body[0], read_through(reads))

        def grouped(*idx):
            *outer, group, gate, unit = idx
            return substitute(body, dict(zip(handles, (*outer, gate * units + group * per_group + unit))))
        shape = [*op.output(0).shape[:-1], units // per_group, gates, per_group]
        new = te.compute(shape, grouped, name=op.name, tag=op.tag, attrs=dict(op.attrs))

        def reader(*idx, t=new):
            *outer, column = idx
            return t[(*outer, column % units // per_group, column // units, column % per_group)]
        return new.op, reader

    new_of, replaced = sweep(program.stages, rewrite)
    return program.rebuilt(new_of) if replaced else program
