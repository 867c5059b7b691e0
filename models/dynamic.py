"""Builders' models with symbolic batch and sequence dimensions, for dynamic shapes (souffle_py/dynamic.py).

`symbolic(name, ...)` builds a registry model and renames its input and output dimensions 0 and 1 to the
dim_params "batch" and "sequence"; for BERT its Reshape targets become [0, -1, ...] (copy the batch, infer
the sequence), so the graph computes the same function at every batch and length, as exported models do.
"""

from __future__ import annotations

import onnx
from onnx import numpy_helper

from models.registry import build_model

RESHAPES = {"bert": ("heads_shape", "hidden_shape")}


def symbolic(name: str = "bert", tiny: bool = False, seed: int = 0, **overrides) -> onnx.ModelProto:
    if name not in RESHAPES:
        raise ValueError(f"symbolic batch and sequence are known for {sorted(RESHAPES)}, not {name!r}")
    proto = build_model(name, tiny=tiny, seed=seed, **overrides)
    for init in proto.graph.initializer:
        if init.name in RESHAPES[name]:
            target = numpy_helper.to_array(init).copy()
            target[0], target[1] = 0, -1
            init.CopyFrom(numpy_helper.from_array(target, init.name))
    for value in list(proto.graph.input) + list(proto.graph.output):
        dims = value.type.tensor_type.shape.dim
        dims[0].dim_param, dims[1].dim_param = "batch", "sequence"
    onnx.checker.check_model(proto)
    return proto
