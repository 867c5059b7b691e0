"""What the int8 rewrites (int8_gemm.py, int8_conv.py) read off the TE program: the integer tensor behind
a read of a DequantizeLinear TE (frontend/ops/quantize.py's form), constants as arrays, a float32 sum of
a product of two reads, and new constants."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tvm
from tvm import te, tirx

from souffle_py.ir.exprs import substitute
from souffle_py.ir.graph import TENSOR_LOAD
from te_passes.quant import ACC, DEQUANTIZE_TAG


@dataclass(frozen=True)
class Dequantized:
    """A read of a DequantizeLinear TE: the integer tensor it reads and how, its zero point and scale as
    arrays (one element per tensor; per axis: along `axis` of the integer tensor)."""

    source: te.Tensor
    indices: list
    zero: np.ndarray
    scale: np.ndarray
    axis: int


def add_param(params, param_tensors, array: np.ndarray, name: str) -> te.Tensor:
    base, n = name, 1
    while name in params:
        name, n = f"{base}_{n}", n + 1
    params[name] = array
    param_tensors[name] = te.placeholder(array.shape, str(array.dtype), name=name)
    return param_tensors[name]


def product_reads(op):
    """(reduce, [load a, load b]) of a float32 sum of a product of two reads; None for anything else."""
    if not isinstance(op, te.ComputeOp) or len(op.body) != 1 or not op.reduce_axis or not op.axis:
        return None
    reduce = op.body[0]
    if not isinstance(reduce, tirx.Reduce) or str(op.output(0).dtype) != "float32" or len(reduce.source) != 1:
        return None
    if not _is_sum(reduce) or (reduce.condition is not None and not _is_true(reduce.condition)):
        return None
    product = reduce.source[0]
    if not isinstance(product, tirx.Mul) or not all(is_load(x) for x in (product.a, product.b)):
        return None
    return reduce, [product.a, product.b]


def dequantized(program, load) -> Dequantized | None:
    """The integer read behind a read of a DequantizeLinear TE (frontend/ops/quantize.py's form:
    float32(int32(q[i]) - int32(zp)) * scale), or None."""
    tensor, indices = load.args[0], list(load.args[1:])
    op = tensor.op
    if not isinstance(op, te.ComputeOp) or DEQUANTIZE_TAG not in (op.attrs or {}):
        return None
    body = op.body[0]
    try:
        sub, scale_expr = body.a.value, body.b
        if isinstance(sub, tirx.Cast):  # a zero point of 0, simplified away
            q_load, zero_expr = sub.value, tirx.const(0, ACC)
        else:
            q_load, zero_expr = sub.a.value, sub.b
    except AttributeError:
        return None
    if not is_load(q_load) or dtype(q_load) not in ("int8", "uint8"):
        return None
    zero, scale = constant(program, zero_expr), constant(program, scale_expr)
    if zero is None or scale is None:
        return None
    mapping = {iv.var.__chandle__(): i for iv, i in zip(op.axis, indices)}
    q_indices = [substitute(e, mapping) for e in q_load.args[1:]]
    return Dequantized(q_load.args[0], q_indices, zero, scale, int(op.attrs[DEQUANTIZE_TAG]))


def constant(program, expr) -> np.ndarray | None:
    """An immediate, or a read of a constant (through casts), as an array; None for anything computed."""
    while isinstance(expr, tirx.Cast):
        expr = expr.value
    if isinstance(expr, (tirx.IntImm, tirx.FloatImm)):
        return np.array([expr.value])
    if is_load(expr) and expr.args[0].op.name in program.params:
        return np.asarray(program.params[expr.args[0].op.name]).reshape(-1)
    return None


def is_load(expr) -> bool:
    return isinstance(expr, tvm.ir.Call) and expr.op.same_as(TENSOR_LOAD)


def _is_sum(reduce) -> bool:
    combiner = reduce.combiner
    return len(combiner.result) == 1 and isinstance(combiner.result[0], tirx.Add)


def _is_true(cond) -> bool:
    return isinstance(cond, tirx.IntImm) and cond.value == 1




def dtype(expr) -> str:
    """An expression's dtype (TVM 0.27 calls carry it as `.ty`)."""
    return str(expr.dtype) if hasattr(expr, "dtype") else str(expr.ty)
