"""Scalar stages first: each loop nest of a kernel that computes one value (a dynamic quantization's scale
and zero point, a product of scales) moved up to just after the nests computing what it reads.

A merged kernel's nests come in the program's topological order, a post-order walk from the outputs: an
ONNX graph that multiplies the scales after its MatMulInteger (quantize_dynamic's) places that product
between the integer GEMM and the GEMM's epilogue. The epilogue can then not be computed in the GEMM's tile
write-back (schedule/epilogue.py needs every map it reads computed before the GEMM's nest) and took a pass
over the int32 map of its own (BERT-base's stacked Q / K / V: 1.1 ms at 1.3 GFLOP/s). A scalar nest is
cheap and reads nothing the GEMM writes, so moving it is free and keeps the topological order.
"""

from __future__ import annotations

import math

import tvm_ffi
from tvm import s_tir, tirx


def scalars_early(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` (unscheduled) with each one-value nest right after the last nest writing a map it reads (first
    where it reads only parameters); the other nests keep their order."""
    realize = func.body
    if not isinstance(realize, s_tir.stmt.SBlockRealize) or not isinstance(realize.block.body, tirx.SeqStmt):
        return func
    root = realize.block
    order: list = []  # (nest, the buffers its blocks write)
    moved = False
    for nest in root.body.seq:
        blocks = _blocks(nest)
        writes = [region.source for block in blocks for region in block.writes]
        if blocks and all(_one_value(b) for b in writes):
            reads = [region.source for block in blocks for region in block.reads]
            after = max((i + 1 for i, (_, written) in enumerate(order)
                         if any(w.same_as(r) for w in written for r in reads)), default=0)
            moved |= after < len(order)
            order.insert(after, (nest, writes))
        else:
            order.append((nest, writes))
    if not moved:
        return func
    new_root = s_tir.stmt.SBlock(root.iter_vars, root.reads, root.writes, root.name_hint,
                                 tirx.SeqStmt([nest for nest, _ in order]), root.init, root.alloc_buffers,
                                 root.match_buffers, root.annotations)
    return func.with_body(s_tir.stmt.SBlockRealize(realize.iter_values, realize.predicate, new_root))


def _blocks(nest) -> list:
    found = []
    tvm_ffi.structural_walk(nest, [(s_tir.stmt.SBlock, found.append)])
    return found


def _one_value(buffer) -> bool:
    return all(isinstance(d, tirx.IntImm) for d in buffer.shape) and math.prod(int(d) for d in buffer.shape) == 1
