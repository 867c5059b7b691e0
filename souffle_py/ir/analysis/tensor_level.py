"""Tensor-level facts (paper sec. 5.1 and 5.3): per TE its size, work, compulsory traffic and class, and per
tensor its live range; the partitioner cuts at CI TEs and the memory planner needs the live bytes.

Classification. A TE is compute-intensive (CI) when it is a contraction -- a GEMM/GEMV/conv-like reduction
whose source reads at least two distinct operands across the reduction domain, one of them reused by several
output elements -- or when its arithmetic intensity reaches CI_THRESHOLD flops per byte of compulsory
traffic. Everything else (elementwise, data movement, softmax/LayerNorm reductions) is memory-intensive (MI).
docs/analysis.md explains the threshold and why batch-1 GEMVs count as CI.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import tvm
from tvm import te

from souffle_py.ir.analysis.body import Read, index_signature, operations_per_point, reads, variables
from souffle_py.ir.analysis.naming import Names
from souffle_py.ir.graph import tensor_key

# Flops per byte of compulsory traffic at and above which a non-contraction TE is CI. Single-op elementwise and
# reduction TEs stay below ~1.3 (a LayerNorm variance: 5 ops per 4-byte element); a machine's ridge point
# (flops/s over bytes/s) is ~7 on this CPU and ~13 on an A100, so a TE above 4 is close to compute-bound.
CI_THRESHOLD = 4.0


@dataclass(frozen=True, eq=False)
class TEStats:
    """What one TE computes and moves, counted over its iteration domain (output x reduction domain)."""

    name: str
    op: te.ComputeOp = field(repr=False)
    origin: str | None  # the ONNX node it was lowered from, when known
    index: int  # position in the program's topological order
    shape: tuple[int, ...]  # of its (first) output
    dtype: str
    bytes: int  # of all its outputs
    points: int  # iteration-domain size
    flops: int  # operations on data values (index arithmetic excluded)
    loads: int  # element reads, guarded reads counted as if always taken
    stores: int  # elements written
    traffic_bytes: int  # compulsory: distinct elements read (estimated) and written, in bytes
    intensity: float  # flops / traffic_bytes
    contraction: bool
    klass: str  # "CI" or "MI"


@dataclass(frozen=True)
class TensorInfo:
    """A tensor of the program and its live range in program order.

    live = (definition, last use): a placeholder is defined at -1, a program output is used until
    len(stages), a tensor nobody reads ends where it starts.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    kind: str  # "input" | "param" | "intermediate" | "output"
    producer: str | None  # TE name; None for a placeholder
    readers: tuple[str, ...]  # TEs that read it, in program order
    live: tuple[int, int]


@dataclass(frozen=True)
class LivePeak:
    """The step of program order where TE-produced tensors occupy the most memory (placeholders excluded:
    weights and inputs are resident for the whole run anyway)."""

    bytes: int
    step: int
    te: str | None  # the TE at that step (None for a program without TEs)


def shape_of(tensor: te.Tensor) -> tuple[int, ...]:
    return tuple(int(d) for d in tensor.shape)


def itemsize(dtype: str) -> int:
    dt = tvm.runtime.DataType(dtype)
    return (dt.bits * dt.lanes + 7) // 8


def tensor_bytes(tensor: te.Tensor) -> int:
    return math.prod(shape_of(tensor)) * itemsize(str(tensor.dtype))


def _extent(iter_var) -> int:
    return int(iter_var.dom.extent)


def is_contraction(op: te.ComputeOp, op_reads: list[Read]) -> bool:
    """GEMM/conv-like: >= 2 distinct reads vary with a reduction variable, and one of them misses an output
    axis of extent > 1, i.e. each of its elements feeds several outputs (the data reuse that makes GEMM
    compute-bound; a LayerNorm variance reads x twice at one index, an MSE reads two tensors without reuse)."""
    if not op.reduce_axis:
        return False
    reduce_vars = {iv.var.__chandle__() for iv in op.reduce_axis}
    out_vars = {iv.var.__chandle__() for iv in op.axis if _extent(iv) > 1}
    ranging = {}
    for read in op_reads:
        used = variables(read.indices)
        if used & reduce_vars:
            ranging[index_signature(read)] = used
    return len(ranging) >= 2 and any(out_vars - used for used in ranging.values())


def te_flops(op: te.ComputeOp) -> int:
    """Operations on data values over the TE's whole iteration domain (a multiply-add counts two)."""
    return operations_per_point(op) * math.prod(_extent(iv) for iv in list(op.axis) + list(op.reduce_axis))


def te_stats(op: te.ComputeOp, index: int, names: Names, origin: str | None = None,
             op_reads: list[Read] | None = None) -> TEStats:
    """The tensor-level record of one TE (op_reads: body.reads(op), when the caller has it already)."""
    op_reads = reads(op) if op_reads is None else op_reads
    points = math.prod(_extent(iv) for iv in list(op.axis) + list(op.reduce_axis))
    outputs = [op.output(i) for i in range(op.num_outputs)]
    out_bytes = sum(tensor_bytes(t) for t in outputs)
    per_tensor: dict[tuple, int] = {}
    for read in op_reads:
        per_tensor[tensor_key(read.tensor)] = per_tensor.get(tensor_key(read.tensor), 0) + points
    # Distinct elements read: at most the tensor, at most the reads (exact for injective and whole-tensor reads).
    read_bytes = sum(min(math.prod(shape_of(t)), per_tensor.get(tensor_key(t), 0)) * itemsize(str(t.dtype))
                     for t in op.input_tensors)
    flops = te_flops(op)
    traffic = read_bytes + out_bytes
    intensity = flops / traffic if traffic else 0.0
    contraction = is_contraction(op, op_reads)
    return TEStats(
        name=names.ops[op], op=op, origin=origin, index=index, shape=shape_of(outputs[0]),
        dtype=str(outputs[0].dtype), bytes=out_bytes, points=points, flops=flops,
        loads=len(op_reads) * points, stores=sum(math.prod(shape_of(t)) for t in outputs),
        traffic_bytes=traffic, intensity=intensity, contraction=contraction,
        klass="CI" if contraction or intensity >= CI_THRESHOLD else "MI")


def tensor_infos(placeholders: list[te.Tensor], stages: list[te.ComputeOp], outputs: list[te.Tensor],
                 names: Names, placeholder_kind) -> dict[str, TensorInfo]:
    """Every placeholder and TE output, with readers and live range; placeholder_kind(t) -> 'input'|'param'."""
    readers: dict[tuple, list[int]] = {}
    for i, op in enumerate(stages):
        for key in dict.fromkeys(tensor_key(t) for t in op.input_tensors):
            readers.setdefault(key, []).append(i)
    out_keys = {tensor_key(t) for t in outputs}
    end = len(stages)
    infos = {}
    tensors = [(t, -1) for t in placeholders] + [(op.output(k), i) for i, op in enumerate(stages)
                                                for k in range(op.num_outputs)]
    for tensor, start in tensors:
        key = tensor_key(tensor)
        uses = readers.get(key, [])
        if start < 0:
            kind = placeholder_kind(tensor)
        else:
            kind = "output" if key in out_keys else "intermediate"
        last = end if key in out_keys else max(uses, default=start)
        infos[names.tensors[key]] = TensorInfo(
            name=names.tensors[key], shape=shape_of(tensor), dtype=str(tensor.dtype), bytes=tensor_bytes(tensor),
            kind=kind, producer=None if start < 0 else names.ops[tensor.op],
            readers=tuple(names.ops[stages[u]] for u in uses), live=(start, last))
    return infos


def live_peak(infos: dict[str, TensorInfo], te_names: list[str]) -> LivePeak:
    """The maximum over program steps of the bytes of TE-produced tensors live at that step (a sweep)."""
    steps = len(te_names)
    delta = [0] * (steps + 1)
    for info in infos.values():
        start, last = info.live
        if start >= 0:
            delta[start] += info.bytes
            delta[min(last, steps - 1) + 1] -= info.bytes
    best, step, live = 0, 0, 0
    for i in range(steps):
        live += delta[i]
        if live > best:
            best, step = live, i
    return LivePeak(bytes=best, step=step, te=te_names[step] if steps else None)
