"""Attention over ragged windows computed with its (window, head) pairs in vector lanes (CPU backend).

Swin's window attention multiplies 49 x 32 by 32 x 49 per window and head and normalizes rows of 49. No
vector of 4 or more lanes divides 49, so the default GEMM's column tile and the softmax's row vectors
(schedule/default.py) both fall back to scalar code: on a Zen 4 host stage 0's scores ran at ~10 GFLOP/s
and the softmax at ~12 cycles per element, 37 ms of Swin-B's 227 against ONNX Runtime's 6.
Stored with the B x H (window, head) pairs innermost, [B, H, R, X] as [B * H / L, R, X, L], every TE of the
chain is a vector over L pairs whatever R and X are: the scores a register tile of rows by L pairs per
reduction step, the row max, sum and normalization L rows at once. Pair p = h * B + b, windows fastest,
so that a bias shared by the windows (Swin's relative position bias) is one value for all lanes where a
head has L windows or more. The batched matmul's operand copies (layout.py's transposed K, the scaled Q)
join the chain when it is their only reader; TEs reading the chain from outside (the context GEMM) read
it through the new layout, as do the chain's elementwise reads of anything else (gathers over the lanes).
A batched matmul's operand from outside the chain (V, a slice of a fused QKV projection) is copied into
the lane layout first: gathered per lane inside the product, MobileViT's P.V ran at 2.8 GFLOP/s.
Values are unchanged; only where the intermediate tensors live changes.
"""

from __future__ import annotations

import logging

import tvm
from tvm import te

from souffle_py.ir.program import TEProgram
from souffle_py.ir.analysis.body import variables
from souffle_py.ir.exprs import simplify_reads, substitute
from souffle_py.ir.graph import map_loads, read_through, sweep, tensor_loads, with_reduce_source
from souffle_py.ir.marks import member_of

log = logging.getLogger(__name__)


def batches_in_lanes(program: TEProgram, lanes: int) -> TEProgram:
    """`program` with each batched matmul over [B, H] pairs (B * H a multiple of `lanes`) whose columns no
    vector of `lanes` divides, its operand copies and the elementwise and row-reduction TEs reading it
    (transitively), stored as [B * H / lanes, R, X, lanes] (module docstring); unchanged when none
    qualifies."""
    outputs = {t.op for t in program.outputs.values()}
    consumers = program.consumers()
    pairs: dict = {}  # chain member -> (B, H)
    for op in program.stages:
        if op not in pairs and _ragged_batched_matmul(op, lanes, outputs):
            shape = _shape(op)
            pairs.update({member: tuple(shape[:2]) for member in _chain(op, consumers, outputs)})
    if not pairs:
        return program

    def rewrite(op, reads):
        if op not in pairs:
            return None
        b_count, h_count = pairs[op]
        if _ragged_batched_matmul(op, lanes, outputs):
            op = _operands_in_lanes(op, b_count, lanes, set(pairs), reads)
        new = _in_lanes(op, b_count, h_count, lanes, reads)

        def reader(b, h, r, x, t=new, count=b_count):
            return t[(h * count + b) // lanes, r, x, (h * count + b) % lanes]
        return new.op, reader

    new_of, _ = sweep(program.stages, rewrite)
    log.info("%d batched matmuls over ragged rows compute (window, head) pairs in %d lanes (%d TEs)",
             sum(1 for op in pairs if _ragged_batched_matmul(op, lanes, outputs)), lanes, len(pairs))
    return program.rebuilt(new_of)


def _shape(op) -> list[int]:
    return [int(d) for d in op.output(0).shape]


def _plain(op, outputs) -> bool:
    """A single-output float32 4-D compute TE outside recurrences and the program's outputs."""
    return (isinstance(op, te.ComputeOp) and op.num_outputs == 1 and len(op.axis) == 4 and op not in outputs
            and member_of(op) is None and str(op.output(0).dtype) == "float32")


def _ragged_batched_matmul(op, lanes: int, outputs) -> bool:
    """A [B, H, R, X] sum over one axis k of a product of two reads that both depend on k and on the
    (B, H) pair, X not a multiple of `lanes` (the default GEMM's narrowest column tile) and B * H a
    multiple of `lanes`."""
    if not _plain(op, outputs) or len(op.reduce_axis) != 1 or not isinstance(op.body[0], tvm.tirx.Reduce):
        return False
    source, k = op.body[0].source[0], op.reduce_axis[0].var
    if not isinstance(source, tvm.tirx.Mul):
        return False
    pairs = {iv.var.__chandle__() for iv in op.axis[:2] if int(iv.dom.extent) > 1}
    for operand in (source.a, source.b):
        loads = tensor_loads(operand)
        if len(loads) != 1 or k.__chandle__() not in variables(loads[0].args[1:]):
            return False
        if not pairs & variables(loads[0].args[1:]):  # one operand for every pair: a GEMM over all rows
            return False  # (EdgeNeXt's MLP over [1, 16, 16, 352] maps: 48 GFLOP/s in lanes of 16 rows)
    b, h, _, x = _shape(op)
    return (b * h) % lanes == 0 and x % lanes != 0


def _chain(matmul, consumers, outputs) -> set:
    """The matmul, the elementwise copies it alone reads (its operands), and the TEs reading chain members
    elementwise or reducing their rows, each reading every member at its own (window, head) pair."""
    shape = _shape(matmul)
    chain = {matmul}
    for load in tensor_loads(matmul.body[0]):
        producer = load.args[0].op
        if (_plain(producer, outputs) and not producer.reduce_axis and _shape(producer)[:2] == shape[:2]
                and consumers.get(producer, []) == [matmul] and _reads_own_pairs(matmul, {producer})):
            chain.add(producer)
    frontier = [matmul]
    while frontier:
        op = frontier.pop()
        for reader in consumers.get(op, []):
            if reader not in chain and _row_op(reader, shape, outputs) and _reads_own_pairs(reader, chain):
                chain.add(reader)
                frontier.append(reader)
    return chain


def _row_op(op, shape, outputs) -> bool:
    """An elementwise TE over [B, H, R, X] or a reduction of its rows to [B, H, R, 1] (softmax's parts)."""
    if not _plain(op, outputs) or _shape(op)[:3] != shape[:3]:
        return False
    if not op.reduce_axis:
        return _shape(op)[3] == shape[3]
    return len(op.reduce_axis) == 1 and _shape(op)[3] == 1 and int(op.reduce_axis[0].dom.extent) == shape[3]


def _reads_own_pairs(op, chain) -> bool:
    """Whether every read of a chain member in `op` is at `op`'s own first two indices (its pair; an axis of
    extent 1 may be read at 0, as the frontend writes Swin's last stage with one window)."""
    def own(index, iv):
        return index.same_as(iv.var) or (int(iv.dom.extent) == 1 and isinstance(index, tvm.tirx.IntImm)
                                         and index.value == 0)
    return all(own(ld.args[1], op.axis[0]) and own(ld.args[2], op.axis[1])
               for ld in tensor_loads(op.body[0]) if ld.args[0].op in chain)


def _operands_in_lanes(op, b_count: int, lanes: int, chain, mapping) -> te.ComputeOp:
    """The matmul `op` reading each operand from outside the chain (MobileViT's V, a slice of the fused QKV
    projection [patch, token, head * d + x]) from a copy stored [B * H / lanes, K, X, lanes] (or [.., R, K,
    ..] for the left operand): read in place, every lane of a vector gathered from another head and patch
    (2.8 GFLOP/s, 3.7 of 16 ms); the copy is R (or X) times smaller than the product's work."""
    b, h, r, x = (iv.var for iv in op.axis)
    k = op.reduce_axis[0]
    source = op.body[0].source[0]
    operands = []
    for operand in (source.a, source.b):
        loads = tensor_loads(operand)
        free = [v for v in (r, x) if not any(v.__chandle__() in variables(ld.args[1:]) for ld in loads)]
        if any(ld.args[0].op in chain for ld in loads) or len(free) != 1:
            operands.append(operand)
            continue
        kept, extent = (x, int(op.axis[3].dom.extent)) if free[0].same_as(r) else (r, int(op.axis[2].dom.extent))
        handles = (b.__chandle__(), h.__chandle__(), k.var.__chandle__(), kept.__chandle__(), free[0].__chandle__())
        rows_first = kept.same_as(r)
        inner = (extent, int(k.dom.extent)) if rows_first else (int(k.dom.extent), extent)
        shape = (int(op.axis[1].dom.extent) * b_count // lanes, *inner, lanes)
        copied = te.compute(shape, _operand_copy(map_loads(operand, read_through(mapping)), handles, b_count, lanes,
                                                 rows_first), name=f"{op.name}_operand{len(operands)}")
        pair = h * b_count + b
        operands.append(copied(*((pair // lanes, kept, k.var, pair % lanes) if rows_first
                                 else (pair // lanes, k.var, kept, pair % lanes))))
    if all(new.same_as(old) for new, old in zip(operands, (source.a, source.b))):
        return op
    return with_reduce_source(op, tvm.tirx.Mul(*operands))


def _operand_copy(operand, handles, b_count: int, lanes: int, rows_first: bool):
    """The compute function of `operand` (over b, h, k, the kept axis, the unused axis: `handles`) stored
    [pairs / lanes, kept, k, lanes] when `rows_first`, else [pairs / lanes, k, kept, lanes]."""
    zero = tvm.tirx.IntImm("int32", 0)

    def copy(q, i, j, lane):
        pair = q * lanes + lane
        k, kept = (j, i) if rows_first else (i, j)
        return substitute(operand, dict(zip(handles, (pair % b_count, pair // b_count, k, kept, zero))))
    return copy


def _in_lanes(op, b_count: int, h_count: int, lanes: int, mapping) -> te.Tensor:
    """`op` computed as [B * H / lanes, R, X, lanes]: its body at pair p = q * lanes + l (b = p % B,
    h = p // B), reading the tensors already stored so through `mapping` (graph.sweep's reads)."""
    _, _, rows, cols = _shape(op)
    handles = [iv.var.__chandle__() for iv in op.axis]
    body = map_loads(op.body[0], read_through(mapping))
    extents = {iv.var: int(iv.dom.extent) for iv in op.reduce_axis}

    def in_lanes(q, r, x, lane):
        pair = q * lanes + lane
        value = substitute(body, dict(zip(handles, (pair % b_count, pair // b_count, r, x))))
        return simplify_reads(value, {q: b_count * h_count // lanes, r: rows, x: cols, lane: lanes, **extents})
    return te.compute((b_count * h_count // lanes, rows, cols, lanes), in_lanes, name=f"{op.name}_lanes",
                      tag=op.tag)
