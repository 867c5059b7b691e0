"""Which contractions of a grid kernel keep a schedule of their own (transplant.py), convolutions as
implicit GEMMs among them (paper section 6.4; SOUFFLE merges ResNeXt's convolutions so).

dlight's GEMM rule schedules a contraction of two operands alone as a GEMM: it re-indexes both operands
into matrices (a convolution's input into [output points, input channels x window]: an im2col that is
never stored, the re-indexed reads inlined into the shared-memory loads together with the input's
padding), pads the GEMM to whole tiles and tiles it. With the grid kernel's thread block
(transplant.GridMatmul) that schedule transplants into the kernel's launch nest: its tiles in a
grid-stride loop over the kernel's blocks, its loads over the kernel's threads, its element-wise epilogue
(batch norm, activation, residual add) in each thread's write-back, and its input's padding, where only
it reads the padded copy, in its loads (a prologue).

A grid kernel gives a schedule of its own (`in_grid`) to a contraction of two distinct operands that is
- a GEMM of whole 64 x 64 x 16 tiles (which grid.py's own tile takes where no schedule transplants), or
- of at least OWN_SCHEDULE_MFLOP (what would otherwise keep a tiled kernel of its own), and dlight's rule
  schedules it: a dense convolution (grouped and depthwise weights are no matrix over the input's
  channels), a GEMM whose shape is not whole tiles (197 tokens, 96 channels: padded to tiles).
Smaller contractions keep the launch nest's warp or thread per output, and a large one that dlight does
not schedule gets a tiled kernel of its own (partition.py). The kernel function carries the names of its stages so chosen (`mark`), which the
schedule selects (`selector`).
"""

from __future__ import annotations

from tvm import s_tir, te, tirx

from souffle_py.backends.cuda.grid import tileable
from souffle_py.backends.cuda.split_k import OWN_KERNEL_MFLOP, contraction_mflop, tiles_in_grid
from souffle_py.backends.cuda.transplant import dlight_stage_trace
from souffle_py.schedule.blocks import block_kind
from souffle_py.schedule.stages import compute_stages
from souffle_py.ir.graph import isolate, tensor_key
from souffle_py.ir.marks import member_of

OWN_SCHEDULES = "souffle.own_schedules"   # function attribute: the stages that keep schedules of their own
# convolutions and GEMMs of other shapes from this size on: what would otherwise keep a tiled kernel of its
# own (partition.py). Smaller ones keep the launch nest's thread or warp per output: a stage alone on
# dlight's schedule takes ~80 registers, and in EfficientNet-b0 its demand cut a kernel more (4 -> 5)
# for convolutions of a few MFLOP.
OWN_SCHEDULE_MFLOP = OWN_KERNEL_MFLOP


def _two_operands(sch, block) -> bool:
    return len({region.source.name for region in sch.get(block).reads}) == 2


def dlight_schedules(op, target) -> bool:
    """Whether dlight's GEMM rule, with a grid kernel's thread block, schedules the contraction `op` alone
    (made once per distinct stage)."""
    inputs, results = isolate(op)
    func = te.create_prim_func([*inputs, *results])
    stages = compute_stages(func)
    if len(stages) != 1:
        return False
    sch = s_tir.Schedule(func)
    return _two_operands(sch, sch.get_sblock(stages[0].block)) and dlight_stage_trace(stages[0].func, target) is not None


def in_grid(target):
    """op -> whether a grid kernel computes it on a schedule of its own (above): the partition's, the stage
    demands' and the kernel's question, answered once per op. Two distinct operands, as the kernel's
    `selector` requires: attention's Q.K^T reading one Q/K/V tensor twice stays a warp per output, and its
    demand must be that one (taken for a GEMM stage's, it hid BERT-base's occupancy cuts)."""
    answers: dict = {}

    def answer(op) -> bool:
        if op not in answers:
            mflop = contraction_mflop(op)
            answers[op] = member_of(op) is None and mflop > 0 \
                and len({tensor_key(t) for t in op.input_tensors}) == 2 \
                and (tiles_in_grid(op) or (mflop >= OWN_SCHEDULE_MFLOP and dlight_schedules(op, target)))
        return answers[op]

    return answer


def mark(func: tirx.PrimFunc, stages) -> tirx.PrimFunc:
    """`func` (a grid kernel) with the names of its blocks that keep schedules of their own."""
    return func.with_attr(OWN_SCHEDULES, list(stages))


def selector(func: tirx.PrimFunc):
    """(sch, block) -> whether the grid kernel `func` gives `block` a schedule of its own: the stages
    `mark` named, else (a kernel made without marks) the GEMMs of whole tiles."""
    named = func.attrs.get(OWN_SCHEDULES) if func.attrs is not None else None
    if named is None:
        return tileable
    names = {str(name) for name in named}
    return lambda sch, block: sch.get(block).name_hint in names and block_kind(sch, block) in ("gemm", "conv") \
        and _two_operands(sch, block)


def any_stage(sch, block) -> bool:
    """The selector of a contraction alone (the partition already chose it)."""
    return True
