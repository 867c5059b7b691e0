"""An ONNX model read from a path or copied from a ModelProto, with the errors a user can act on. A leaf
(onnx and the errors only): the frontend checks and lowers what it returns, and a dynamic model reads its
ONNX file with it in a process that never imports the compiler."""

from __future__ import annotations

import os

import onnx

from souffle_py.errors import ModelLoadError


def read_onnx(model) -> onnx.ModelProto:
    """The model as given (a copy of a ModelProto): symbolic dimensions kept, nothing checked;
    ModelLoadError where it is no ONNX model."""
    if isinstance(model, onnx.ModelProto):
        proto = onnx.ModelProto()
        proto.CopyFrom(model)
        return proto
    if not isinstance(model, (str, os.PathLike)):
        raise ModelLoadError(f"expected a path or an onnx.ModelProto, got {type(model).__name__}")
    if not os.path.isfile(model):
        raise ModelLoadError(f"no such file: '{model}'")
    try:
        return onnx.load(os.fspath(model))
    except Exception as exc:  # noqa: BLE001  (protobuf and onnx raise several types)
        raise ModelLoadError(f"'{model}' is not a valid ONNX model (it could not be parsed: {exc})") from None
