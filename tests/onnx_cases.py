"""Build one-node ONNX models and compare souffle-py with ONNX Runtime on them (shared by the op tests)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

import souffle_py
from models.common import IR_VERSION
from souffle_py.baselines import OnnxRuntimeModel

RTOL, ATOL = 1e-4, 1e-5  # float32: about 1e-4 relative, as the frontend issue states


def single_node_model(op_type: str, inputs: dict, outputs: int = 1, consts: dict | None = None,
                      opset: int = 17, **attrs) -> onnx.ModelProto:
    """A model with one `op_type` node: `inputs` are graph inputs (name -> example array),
    `consts` initializers; the node's inputs are their names in order (None = omitted optional input)."""
    consts = consts or {}
    names = list(inputs) + list(consts)
    node_inputs = attrs.pop("node_inputs", names)
    out_names = [f"y{i}" for i in range(outputs)]
    node = helper.make_node(op_type, [n or "" for n in node_inputs], out_names, name=f"{op_type.lower()}_node",
                            **attrs)
    graph = helper.make_graph(
        [node], "case",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
         for n, v in inputs.items()],
        [helper.make_tensor_value_info(n, onnx.TensorProto.UNDEFINED, None) for n in out_names],
        [numpy_helper.from_array(np.asarray(v), n) for n, v in consts.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=IR_VERSION)
    return onnx.shape_inference.infer_shapes(model)


def assert_matches_ort(model: onnx.ModelProto, feeds: dict, rtol=RTOL, atol=ATOL) -> dict:
    """Compile with souffle-py, run both, compare every output; returns souffle-py's outputs."""
    compiled = souffle_py.optimize(model)
    ours = compiled.run(feeds)
    reference = OnnxRuntimeModel(model, threads=1).run(feeds)
    assert list(ours) == list(reference)
    for name, expected in reference.items():
        assert ours[name].shape == expected.shape, name
        assert ours[name].dtype == expected.dtype, name
        np.testing.assert_allclose(ours[name], expected, rtol=rtol, atol=atol, err_msg=name)
    return ours


def check_op(op_type: str, inputs: dict, outputs: int = 1, consts: dict | None = None, opset: int = 17,
             **attrs) -> dict:
    model = single_node_model(op_type, inputs, outputs, consts, opset, **attrs)
    return assert_matches_ort(model, inputs)
