"""GEMM columns padded up to the weight panel (CPU backend): ragged N computed as whole panels.

The default GEMM reads its constant weight in panels of P columns (layout.py) with a register tile P
columns wide. A GEMM whose N columns P does not divide (EdgeNeXt's 88- and 168-channel MLPs) had no
panels: its weight was read row-major, K lines per tile, and its last column tile was padded at run time
(ragged.pad_to_tiles copies the operands). Here such a GEMM computes ceil(N / P) * P columns over its
weight zero-padded at compile time, as oneDNN's and XNNPACK's packed weights are; its readers read the
first N columns, so no value changes, and the padding columns (zeros) are never read. The weight is then
packed like any other. A computed operand (attention's Q.K^T reads K's rows as its columns: 197 tokens in
ViT and DeiT, 1500 in Whisper) is read through a copy zero-padded alike, which the scores' GEMM reads in
whole vectors instead of padding its operands at run time (DeiT-tiny 0.96x of before). Only GEMMs whose
padding adds at most PAD_TOLERANCE of their work, outside the program's outputs (whose shape is the
model's) and recurrences.
"""

from __future__ import annotations

import logging

import numpy as np
import tvm
from tvm import te

from souffle_py.ir.program import TEProgram
from souffle_py.ir.analysis.body import variables
from te_passes.channel_padding import padded_size
from souffle_py.ir.exprs import substitute
from souffle_py.ir.graph import map_loads, read_through, sweep, tensor_key, tensor_loads
from te_passes.layout import MIN_ROWS, fresh_name
from souffle_py.ir.marks import member_of

log = logging.getLogger(__name__)
PAD_TOLERANCE = 0.25  # padded columns, a share of the real ones (88 -> 96: 9%; 168 -> 192: 14%)


def pad_gemm_columns(program: TEProgram, panel: int) -> TEProgram:
    """`program` with each GEMM whose columns `panel` does not divide computing them padded to a multiple
    of `panel` over a zero-padded weight or operand copy (module docstring); unchanged when none qualifies."""
    outputs = {t.op for t in program.outputs.values()}
    params, param_tensors = dict(program.params), dict(program.param_tensors)
    padded: dict[str, te.Tensor] = {}

    def rewrite(op, reads):
        found = _ragged_operand(program, op, panel, outputs)
        if found is None:
            return None
        weight, axis = found
        columns = int(op.output(0).shape[-1])
        width = padded_size(columns, panel)
        if isinstance(weight.op, te.ComputeOp):  # a computed operand (attention's K): a zero-padded copy
            operand = _padded_copy(reads.get(tensor_key(weight), weight), weight, axis, width)
        else:
            if weight.op.name not in padded:
                value = program.params[weight.op.name]
                pads = [(0, 0)] * value.ndim
                pads[axis] = (0, width - columns)
                name = fresh_name(f"{weight.op.name}_cols{width}", params)
                params[name] = np.pad(value, pads)
                param_tensors[name] = padded[weight.op.name] = te.placeholder(
                    params[name].shape, str(value.dtype), name=name)
            operand = padded[weight.op.name]
        body = map_loads(op.body[0], read_through({**reads, tensor_key(weight): operand}))
        handles = [iv.var.__chandle__() for iv in op.axis]
        shape = [int(d) for d in op.output(0).shape[:-1]] + [width]
        new = te.compute(shape, lambda *idx: substitute(body, dict(zip(handles, idx))),
                         name=f"{op.name}_cols", tag=op.tag)
        return new.op, lambda *idx, t=new: t(*idx)

    new_of, replaced = sweep(program.stages, rewrite)
    if not replaced:
        return program
    log.info("%d GEMMs compute their columns padded to panels of %d", replaced, panel)
    return program.rebuilt(new_of, params, param_tensors)


def _padded_copy(source, operand: te.Tensor, axis: int, width: int) -> te.Tensor:
    """`operand` (read through `source`, a tensor or a reader) copied with its `axis` zero-padded to `width`."""
    shape = [int(d) for d in operand.shape]
    real = shape[axis]
    shape[axis] = width
    zero = tvm.tirx.const(0, operand.dtype)
    return te.compute(shape, lambda *idx: tvm.tirx.if_then_else(idx[axis] < real, source(*idx), zero),
                      name=f"{operand.op.name}_cols{width}")


def _ragged_operand(program: TEProgram, op, panel: int, outputs):
    """(operand, axis): the constant weight or computed tensor of GEMM `op` (one reduction of a product of
    two reads, at least MIN_ROWS rows) that alone of its reads depends on the column j, read with j at
    `axis` (W[.., k, j] or W[.., j, k]), where N (op's last axis) is at least `panel`, not a multiple of
    it, and padding it costs at most PAD_TOLERANCE; else None."""
    if (not isinstance(op, te.ComputeOp) or op.num_outputs != 1 or op in outputs or member_of(op) is not None
            or len(op.reduce_axis) != 1 or not isinstance(op.body[0], tvm.tirx.Reduce)
            or not isinstance(op.body[0].source[0], tvm.tirx.Mul) or str(op.output(0).dtype) != "float32"):
        return None
    columns = int(op.output(0).shape[-1])
    rows = int(np.prod([int(iv.dom.extent) for iv in op.axis[:-1]]))
    if columns < panel or columns % panel == 0 or rows < MIN_ROWS or padded_size(columns, panel) > (
            1 + PAD_TOLERANCE) * columns:
        return None
    j = op.axis[-1].var
    reading_j = [ld for ld in tensor_loads(op.body[0].source[0]) if j.__chandle__() in variables(ld.args[1:])]
    if len(reading_j) != 1:
        return None
    tensor, indices = reading_j[0].args[0], list(reading_j[0].args[1:])
    computed = isinstance(tensor.op, te.ComputeOp)
    if not (computed or program.placeholder_kind(tensor) == "param") or len(indices) < 2:
        return None
    axis = next((a for a in (len(indices) - 1, len(indices) - 2) if indices[a].same_as(j)), None)
    if axis is None or int(tensor.shape[axis]) != columns:
        return None
    return tensor, axis
