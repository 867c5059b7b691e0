"""Small helpers shared by the lowering rules: broadcasting, inlined constants, dtype names."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import tvm
from onnx import helper
from tvm import te

INDEX_DTYPE = "int32"  # TE loop variables are int32; data-dependent indices are cast to it
# Element types TVM computes with on the CPU (no bfloat16, float8, int4, string: those are refused by name)
SUPPORTED_DTYPES = frozenset({"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                              "float16", "float32", "float64"})


def onnx_dtype(elem_type: int) -> str:
    return str(np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)))


def dtype_of(expr) -> str:
    """The dtype of a TE expression (TVM 0.27 PrimExprs carry it as `.ty`, tensor reads as `.dtype`)."""
    return str(expr.dtype) if hasattr(expr, "dtype") else str(expr.ty)  # te.Tensor: .dtype too


def shape_of(value) -> tuple[int, ...]:
    return tuple(int(d) for d in value.shape)


def broadcast_shape(*shapes: Sequence[int]) -> tuple[int, ...]:
    return tuple(int(d) for d in np.broadcast_shapes(*[tuple(s) for s in shapes]))


def broadcast_indices(indices: Sequence, in_shape: Sequence[int]) -> list:
    """Indices into a tensor of `in_shape` broadcast (numpy rules, right-aligned) to len(indices) dims."""
    offset = len(indices) - len(in_shape)
    return [0 if int(d) == 1 else indices[offset + i] for i, d in enumerate(in_shape)]


def scalar_const(value: np.ndarray) -> tvm.tirx.PrimExpr:
    """A one-element array as an immediate (so the constant is folded into the code, not loaded)."""
    item = np.asarray(value).reshape(-1)[0]
    dtype = str(np.asarray(value).dtype)
    return tvm.tirx.const(bool(item) if dtype == "bool" else item.item(), dtype)


def operand(ctx, i: int, rank: int):
    """Input i for an elementwise op whose output has `rank` dims: a one-element constant whose rank does
    not raise the output's becomes an immediate, anything else a te.Tensor."""
    value = ctx.value(i)
    if isinstance(value, np.ndarray) and value.size == 1 and value.ndim <= rank:
        return scalar_const(value)
    return ctx.tensor(i)


def read(value, indices: Sequence, out_shape: Sequence[int]):
    """value[indices] with broadcasting, where value is a te.Tensor or an immediate."""
    if isinstance(value, te.Tensor):
        return value(*broadcast_indices(list(indices), shape_of(value))) if value.ndim else value()
    return value


def elementwise(inputs: Sequence, out_shape: Sequence[int], fn, name: str) -> te.Tensor:
    """out[idx] = fn(*[x[broadcast(idx)] for x in inputs]) — the one broadcasting elementwise builder."""
    return te.compute(tuple(out_shape), lambda *idx: fn(*[read(x, idx, out_shape) for x in inputs]), name=name)


def value_shape(value) -> tuple[int, ...]:
    return shape_of(value) if isinstance(value, (te.Tensor, np.ndarray)) else ()
