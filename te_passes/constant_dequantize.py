"""A DequantizeLinear of a constant that no integer kernel took (integer_kernels.py runs first), replaced by
the float32 constant it computes.

Why: ONNX Runtime's static quantizer gives a MatMul's separate bias Add an int8 bias with its own scale
(torch exports nn.Linear on a 3-D or 4-D input as MatMul + Add: BERT's, ConvNeXt's and Swin's linears),
and the frontend keeps every DequantizeLinear a TE (so that int8_gemm.py sees int8 weights).
Such a bias was dequantized again in every inference, in a nest of its own after the GEMM's, and the
GEMM's requantizing epilogue, reading a map computed after the write-back, could not be computed in it
(schedule/epilogue.py `_mark_for_write_back`). The values are the TE's to the bit: the same int32
subtraction and one float32 multiply, in numpy.
"""

from __future__ import annotations

import logging

import numpy as np
from tvm import te

from souffle_py.ir.graph import sweep, tensor_key
from souffle_py.ir.program import TEProgram
from te_passes.int8_reads import add_param, dequantized
from te_passes.quant import ACC, DEQUANTIZE_TAG

log = logging.getLogger(__name__)


def fold_constant_dequantize(program: TEProgram) -> TEProgram:
    """`program` with each DequantizeLinear TE of a constant (read point for point; not an output) a
    float32 constant of its values."""
    params, param_tensors = dict(program.params), dict(program.param_tensors)
    outputs = {tensor_key(t) for t in program.outputs.values()}
    folded = []

    def rewrite(op, reads):
        if DEQUANTIZE_TAG not in (op.attrs or {}) or tensor_key(op.output(0)) in outputs:
            return None
        values = constant_values(program, op)
        if values is None:
            return None
        folded.append(op.name)
        return add_param(params, param_tensors, values, f"{op.name}_values").op

    new_of, replaced = sweep(program.stages, rewrite)
    if not replaced:
        return program
    log.info("constant dequantizations folded: %s", ", ".join(folded))
    return program.rebuilt(new_of, params, param_tensors)


def constant_values(program: TEProgram, op: te.ComputeOp) -> np.ndarray | None:
    """The float32 values of the DequantizeLinear TE `op` where it reads a constant point for point, else None."""
    axes = [iv.var for iv in op.axis]
    found = dequantized(program, op.output(0)(*axes))
    if found is None or found.source.op.name not in program.params:
        return None
    if len(found.indices) != len(axes) or any(not i.same_as(v) for i, v in zip(found.indices, axes)):
        return None
    q = np.asarray(program.params[found.source.op.name])
    zero, scale = _along(q, found.zero, found.axis), _along(q, found.scale, found.axis)
    if q.shape != tuple(int(d) for d in op.output(0).shape) or zero is None or scale is None:
        return None
    return (q.astype(ACC) - zero.astype(ACC)).astype(np.float32) * scale.astype(np.float32)


def _along(q: np.ndarray, values, axis: int) -> np.ndarray | None:
    """`values` (one, or one per index of `axis`) shaped to broadcast against `q`; None for any other count."""
    values = np.asarray(values)
    if values.size == 1:
        return values.reshape(())
    if not 0 <= axis < q.ndim or values.size != q.shape[axis]:
        return None
    shape = [1] * q.ndim
    shape[axis] = values.size
    return values.reshape(shape)
