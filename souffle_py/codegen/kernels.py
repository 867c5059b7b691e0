"""Kernels: PrimFuncs plus the names of the program buffers they read and write.

Kernels whose PrimFuncs are structurally identical (the twelve layers of BERT) share one compiled function,
so kernel functions are built over canonically named placeholders (see merge.py and unfused.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import s_tir, te, tirx

from souffle_py.codegen.fast_math import fast_math as approximate_math
from souffle_py.codegen.recurrence import Loop
from souffle_py.codegen.scalar_order import scalars_early
from souffle_py.ir.program import TEProgram


@dataclass(frozen=True)
class Kernel:
    """One call per inference: `func` applied to the program buffers named in `args` (PrimFunc order)."""

    name: str
    func: tirx.PrimFunc
    args: tuple[str, ...]
    stages: tuple[str, ...]
    reason: str = ""  # why a merged kernel starts where it does (the partitioner's cut reason)
    # recurrences whose back edges are closed after scheduling (recurrence.py); their state parameters of
    # `func` are not in `args`
    loops: tuple[Loop, ...] = ()


def buffer_name(tensor: te.Tensor) -> str:
    """The runtime buffer holding a tensor: placeholders by their name, op outputs by op (and index)."""
    op = tensor.op
    return op.name if op.num_outputs == 1 else f"{op.name}.{int(tensor.value_index)}"


def kernel_func(tensors, fast_math: bool = True) -> tirx.PrimFunc:
    """The PrimFunc computing the output tensors among `tensors` from the others (parameter order kept);
    fast_math: float32 exp/erf/tanh/sigmoid as vectorizable approximations (see fast_math.py)."""
    func = in_bounds_regions(unit_loops(scalars_early(te.create_prim_func(list(tensors)))))
    return approximate_math(func) if fast_math else func


def in_bounds_regions(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """Each block's read regions clipped to the shapes of the buffers it reads. A concat composed into its
    reader reads each branch only where its condition holds, but TVM takes the region from the index alone
    (and simplifies a clamp under the condition away): MixNet int8's if_then_else(0 <= c, .., s47[c + 40]),
    a branch that never runs, read channels 40-79 of a 40-channel map, past what its producer writes, so
    the kernel's scope was no "stage pipeline" and every later reverse_compute_at in it failed (its convs'
    and GEMMs' register tiles refused). A clipped region still holds every element the block reads."""
    def clip(block):
        analyzer = tvm.sym.Analyzer()
        for iv in block.iter_vars:
            analyzer.bind(iv.var, iv.dom)
        reads = [_clipped(region, analyzer) for region in block.reads]
        if all(new.same_as(old) for new, old in zip(reads, block.reads)):
            return block
        return s_tir.stmt.SBlock(block.iter_vars, reads, block.writes, block.name_hint, block.body, block.init,
                                 block.alloc_buffers, block.match_buffers, block.annotations)

    body = tvm_ffi.structural_map(func.body, [(s_tir.stmt.SBlock, clip)])
    return func if body.same_as(func.body) else func.with_body(body)


def _clipped(region, analyzer: tvm.sym.Analyzer):
    """`region` within its buffer's shape (the same object where it is already)."""
    ranges, changed = [], False
    for r, extent in zip(region.region, region.source.shape):
        low, high = analyzer.const_int_bound(r.min), analyzer.const_int_bound(r.min + r.extent)
        if low.min_value >= 0 and high.max_value <= int(extent):
            ranges.append(r)
            continue
        start = tirx.min(tirx.max(r.min, 0), int(extent) - 1)
        end = tirx.max(tirx.min(r.min + r.extent, int(extent)), start + 1)
        ranges.append(tvm.ir.Range.from_min_extent(analyzer.simplify(start), analyzer.simplify(end - start)))
        changed = True
    return s_tir.stmt.TensorRegion(region.source, ranges, region.ty) if changed else region


def unit_loops(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """0-d stages (a block without loops beside other stages: a scalar scale of a dynamically quantized
    model) wrapped in a loop of one: TVM's rfactor, which the default reduction rule applies to a sibling
    reduction, fails on such a bare block (InternalError: block_realize == old_block_realize_)."""
    def wrap(seq):
        if not any(isinstance(s, s_tir.stmt.SBlockRealize) for s in seq.seq):
            return seq
        return tirx.SeqStmt([tirx.For(tirx.Var("unit", "int32"), 0, 1, tirx.ForKind.SERIAL, s)
                             if isinstance(s, s_tir.stmt.SBlockRealize) else s for s in seq.seq])

    body = tvm_ffi.structural_map(func.body, [(tirx.SeqStmt, wrap)])
    return func if body.same_as(func.body) else func.with_body(body)


def buffer_specs(program: TEProgram) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every buffer the kernels of `program` touch: name -> (shape, dtype)."""
    specs = {}
    tensors = list(program.inputs.values()) + list(program.param_tensors.values())
    for op in program.stages:
        tensors += [op.output(i) for i in range(op.num_outputs)]
    for t in tensors:
        specs[buffer_name(t)] = (tuple(int(d) for d in t.shape), str(t.dtype))
    return specs
