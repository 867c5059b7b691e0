"""Load an ONNX model, validate it and make every input shape concrete.

Everything downstream assumes static shapes, so symbolic or unknown input dimensions are an error unless
the caller supplies `input_shapes`; the checker and shape inference run here so that later stages see a
well-formed graph and every failure is reported as a ModelLoadError or ShapeError, not a deep stack trace.
"""

from __future__ import annotations

import operator

import os
from typing import Mapping, Sequence

import onnx
from onnx import shape_inference

from souffle_py.errors import ModelLoadError, ShapeError
from souffle_py.onnx_file import read_onnx


def load_model(model: "str | os.PathLike | onnx.ModelProto",
               input_shapes: Mapping[str, Sequence[int]] | None = None) -> onnx.ModelProto:
    """A checked, shape-inferred copy of `model` whose graph inputs all have concrete shapes."""
    proto = _read(model)
    try:
        onnx.checker.check_model(proto)
    except Exception as exc:  # the checker raises several unrelated exception types
        raise ModelLoadError(f"{_describe(model)} fails the ONNX checker: {exc}") from None
    if input_shapes is not None and not isinstance(input_shapes, Mapping):
        raise ShapeError(f"input_shapes must be a dict of input name -> shape, got {type(input_shapes).__name__}")
    proto = _with_concrete_inputs(proto, dict(input_shapes or {}))
    try:
        return shape_inference.infer_shapes(proto, strict_mode=True, data_prop=True)
    except Exception as exc:
        raise ModelLoadError(f"ONNX shape inference failed on {_describe(model)}: {exc}") from None


def graph_inputs(proto: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """The real inputs: graph inputs that are not initializers (older models list weights as inputs)."""
    weights = {init.name for init in proto.graph.initializer}
    return [vi for vi in proto.graph.input if vi.name not in weights]


def _describe(model) -> str:
    return f"'{model}'" if isinstance(model, (str, os.PathLike)) else "the given ModelProto"


def _read(model) -> onnx.ModelProto:
    proto = read_onnx(model)
    if not proto.graph.node and not proto.graph.output:
        raise ModelLoadError(f"'{model}' is not a valid ONNX model (it has an empty graph)")
    return proto


def _with_concrete_inputs(proto: onnx.ModelProto, input_shapes: dict) -> onnx.ModelProto:
    inputs = {vi.name: vi for vi in graph_inputs(proto)}
    unknown = sorted(set(input_shapes) - set(inputs))
    if unknown:
        raise ShapeError(f"input_shapes names {unknown}, which are not inputs of the model "
                         f"(its inputs: {sorted(inputs)})")
    for name, vi in inputs.items():
        tensor_type = vi.type.tensor_type
        if not vi.type.HasField("tensor_type"):
            raise ShapeError(f"input '{name}' is not a tensor; only tensor inputs are supported")
        if name in input_shapes:
            _set_shape(vi, name, input_shapes[name])
            continue
        if not tensor_type.HasField("shape"):
            raise ShapeError(f"input '{name}' has no shape in the model: pass input_shapes={{'{name}': (...)}}")
        for axis, dim in enumerate(tensor_type.shape.dim):
            if not dim.HasField("dim_value") or dim.dim_value <= 0:
                what = f"symbolic dimension '{dim.dim_param}'" if dim.dim_param else "an unknown dimension"
                raise ShapeError(f"input '{name}' has {what} at axis {axis}; souffle-py compiles for concrete "
                                 f"shapes: pass input_shapes={{'{name}': (...)}}")
    return proto


def _set_shape(vi: onnx.ValueInfoProto, name: str, shape: Sequence[int]) -> None:
    given = shape
    try:
        shape = [operator.index(d) for d in shape]  # ints and numpy ints; not 16.5, not "16"
    except TypeError:
        shape = None
    if shape is None or isinstance(given, (str, bytes)) or any(d <= 0 for d in shape):
        raise ShapeError(f"input_shapes['{name}'] = {given!r}: a shape is a sequence of positive integers")
    old = vi.type.tensor_type.shape
    if old.dim and len(old.dim) != len(shape):
        raise ShapeError(f"input_shapes['{name}'] has rank {len(shape)} but the model declares rank {len(old.dim)}")
    for axis, (dim, value) in enumerate(zip(old.dim, shape)):
        if dim.HasField("dim_value") and dim.dim_value != value:
            raise ShapeError(f"input_shapes['{name}'] gives {value} at axis {axis}, "
                             f"but the model fixes it to {dim.dim_value}")
    del old.dim[:]
    for value in shape:
        old.dim.add().dim_value = value
