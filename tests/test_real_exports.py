"""Forms real exporters write that the models/ builders never did (issue 12's reports), each vs ONNX Runtime."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from models.common import IR_VERSION
from onnx_cases import assert_matches_ort, check_op


def _model(nodes, inputs, output, inits=(), opset=11, shape=None):
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info(output, TensorProto.FLOAT, shape)],
                              list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=IR_VERSION)
    return onnx.shape_inference.infer_shapes(model)


def test_unsqueeze_with_axes_attribute_is_folded_at_the_models_opset():
    """Unsqueeze-11 on a constant: onnx's evaluator given the bare node runs Unsqueeze-13 and fails."""
    shape = numpy_helper.from_array(np.array([2, 3], np.int64), "shape_1d")
    nodes = [helper.make_node("Unsqueeze", ["shape_1d"], ["shape_2d"], axes=[0]),
             helper.make_node("Squeeze", ["shape_2d"], ["shape"], axes=[0]),
             helper.make_node("Reshape", ["x", "shape"], ["y"])]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6])], "y", [shape], shape=[2, 3])
    assert_matches_ort(model, {"x": np.arange(6, dtype=np.float32)})


def test_dropout_with_ratio_attribute_is_the_identity():
    x = np.random.default_rng(0).standard_normal((2, 5)).astype(np.float32)
    check_op("Dropout", {"x": x}, opset=10, ratio=0.3)
    check_op("Dropout", {"x": x}, opset=7, ratio=0.5)  # ONNX Runtime has no Dropout-6 (is_test) kernel


def test_lrn():
    x = np.random.default_rng(1).standard_normal((1, 7, 3, 3)).astype(np.float32)
    check_op("LRN", {"x": x}, opset=13, size=5, alpha=1e-3, beta=0.75, bias=2.0)


def test_reduce_l2_keeps_the_attribute_form():
    x = np.random.default_rng(2).standard_normal((3, 4)).astype(np.float32)
    check_op("ReduceL2", {"x": x}, opset=13, axes=[1], keepdims=1)


def test_bool_mask_ops_build_vectorized_kernels():
    """A 64-element bool mask (a multiple of the vector width) from Equal/Not/And, used by Where."""
    ids = np.array([[1] * 48 + [0] * 16], np.int64)
    nodes = [helper.make_node("Equal", ["ids", "one"], ["keep"]), helper.make_node("Not", ["keep"], ["pad"]),
             helper.make_node("And", ["keep", "keep"], ["both"]), helper.make_node("Or", ["both", "pad"], ["all"]),
             helper.make_node("Xor", ["all", "keep"], ["mask"]),
             helper.make_node("Where", ["mask", "neg", "zero"], ["y"])]
    inits = [numpy_helper.from_array(np.array(1, np.int64), "one"), numpy_helper.from_array(np.float32(-1e9), "neg"),
             numpy_helper.from_array(np.float32(0), "zero")]
    model = _model(nodes, [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 64])], "y", inits, opset=17)
    assert_matches_ort(model, {"ids": ids})
