"""NaN, +-Inf, subnormals and +-3e38 through every supported elementwise, activation and reduction op and
through tiny conv, attention and MLP models, against ONNX Runtime with NaN positions compared exactly.

Where ONNX Runtime's own result depends on where a NaN sits (ReduceMax/Min, ArgMax/Min, Hardmax, MaxPool,
GlobalMaxPool: its loops keep or drop a NaN by position, onnxruntime issue 10514), souffle-py propagates
NaN as IEEE 754-2019's maximum and numpy do; those ops are compared with ONNX Runtime on every special
value but NaN, and with numpy on NaN.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import souffle_py
from models.common import IR_VERSION
from souffle_py.baselines import OnnxRuntimeModel

NAN, INF = np.float32(np.nan), np.float32(np.inf)
SPECIAL = np.array([np.nan, -np.nan, np.inf, -np.inf, 1e-40, -1e-40, 3e38, -3e38, 0.0, -0.0, 1.0, -1.0, 0.5,
                    -2.5, 7.0, -0.3, 0.9, -0.7, 3.5, 2.0], np.float32)
# rows of 37: vector paths with a remainder; every special value in every lane position across the rows
X = np.stack([np.roll(np.resize(SPECIAL, 37), k) for k in range(5)])
Y = np.stack([np.roll(np.resize(SPECIAL[::-1], 37), 3 * k) for k in range(5)])
FINITE_OR_INF = np.where(np.isnan(X), np.float32(2), X)  # every special value but NaN
POSITIVE = np.abs(X) + np.float32(0.5)     # Log, Sqrt, Pow bases: NaN and inf included, no negative numbers

UNARY = ["Abs", "Acos", "Acosh", "Asin", "Asinh", "Atan", "Atanh", "Ceil", "Cos", "Cosh", "Erf", "Exp", "Floor",
         "Neg", "Reciprocal", "Relu", "Round", "Sigmoid", "Sign", "Sin", "Sinh", "Softplus", "Softsign", "Tan",
         "Tanh", "IsNaN", "IsInf", "HardSwish", "Celu", "Elu", "Selu", "LeakyRelu", "HardSigmoid",
         "ThresholdedRelu", "Shrink"]
BINARY = ["Add", "Sub", "Mul", "Div", "Max", "Min", "Mean", "Sum", "Equal", "Greater", "Less", "GreaterOrEqual",
          "LessOrEqual"]


def _model(nodes, inputs: dict, consts: dict | None = None, opset: int = 17, same_shape: bool = False
           ) -> onnx.ModelProto:
    """One graph of independent nodes (op, input names, attrs): each node's output is a graph output (of the
    first input's shape and type where `same_shape`: ops whose shape inference onnx leaves undone)."""
    made, outputs = [], []
    first = next(iter(inputs.values()))
    for i, (op, names, attrs) in enumerate(nodes):
        out = f"{op.lower()}_{i}"
        made.append(helper.make_node(op, names, [out], name=out, **attrs))
        outputs.append(helper.make_tensor_value_info(out, TensorProto.FLOAT, first.shape) if same_shape else
                       helper.make_tensor_value_info(out, TensorProto.UNDEFINED, None))
    graph = helper.make_graph(
        made, "special", [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
                          for n, v in inputs.items()], outputs,
        [numpy_helper.from_array(np.asarray(v), n) for n, v in (consts or {}).items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=IR_VERSION)
    return onnx.shape_inference.infer_shapes(model)


def _assert_same(ours: np.ndarray, expected: np.ndarray, what: str) -> None:
    """Equal NaN positions, equal infinities, finite values within float32 tolerance."""
    assert ours.shape == expected.shape and ours.dtype == expected.dtype, what
    if expected.dtype.kind != "f":
        np.testing.assert_array_equal(ours, expected, err_msg=what)
        return
    np.testing.assert_array_equal(np.isnan(ours), np.isnan(expected), err_msg=f"{what}: NaN positions")
    np.testing.assert_array_equal(np.where(np.isinf(ours), ours, 0), np.where(np.isinf(expected), expected, 0),
                                  err_msg=f"{what}: infinities")
    finite = np.isfinite(expected)
    np.testing.assert_allclose(ours[finite], expected[finite], rtol=1e-4, atol=1e-5, err_msg=what)


def _check_against_ort(model, feeds, **options) -> dict:
    ours = souffle_py.optimize(model, quiet=True, **options).run(feeds)
    reference = OnnxRuntimeModel(model, threads=1).run(feeds)
    for name, expected in reference.items():
        _assert_same(ours[name], expected, name)
    return ours


@pytest.mark.parametrize("fast_math", [True, False])
def test_elementwise_and_activations(fast_math):
    nodes = [(op, ["x"], {}) for op in UNARY]
    nodes += [(op, ["p"], {}) for op in ("Log", "Sqrt")]
    nodes += [(op, ["x", "y"], {}) for op in BINARY]
    nodes += [("Pow", ["p", "y"], {}), ("Max", ["x", "zero"], {}), ("Min", ["x", "zero"], {}),
              ("Clip", ["x", "lo", "hi"], {}), ("Clip", ["x"], {}), ("PRelu", ["x", "slope"], {}),
              ("Where", ["mask", "x", "y"], {}), ("Cast", ["x"], {"to": TensorProto.BOOL}),
              ("Mod", ["x", "y"], {"fmod": 1})]
    consts = {"zero": np.float32(0), "lo": np.float32(-1), "hi": np.float32(1), "slope": np.full(37, 0.1, np.float32)}
    feeds = {"x": X, "y": Y, "p": POSITIVE, "mask": X > Y}
    _check_against_ort(_model(nodes, feeds, consts), feeds, fast_math=fast_math)


@pytest.mark.parametrize("fast_math", [True, False])
def test_gelu_both_forms(fast_math):
    nodes = [("Gelu", ["x"], {}), ("Gelu", ["x"], {"approximate": "tanh"})]
    _check_against_ort(_model(nodes, {"x": X}, opset=20), {"x": X}, fast_math=fast_math)


REDUCTIONS = ["ReduceMax", "ReduceMin", "ReduceSum", "ReduceMean", "ReduceProd", "ReduceL1", "ReduceL2",
              "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare"]
ROW_OPS = [("ArgMax", {"axis": 1}), ("ArgMin", {"axis": 1}), ("Softmax", {"axis": 1}), ("LogSoftmax", {"axis": 1}),
           ("Hardmax", {"axis": 1}), ("CumSum", {})]


def _row_model(x_name: str):
    nodes = [(op, [x_name, "axes"], {"keepdims": 1}) for op in REDUCTIONS]
    nodes += [(op, [x_name] + (["axis"] if op == "CumSum" else []), attrs) for op, attrs in ROW_OPS]
    nodes += [("LayerNormalization", [x_name, "gamma", "beta"], {"axis": -1})]
    consts = {"axes": np.array([1], np.int64), "axis": np.array(1, np.int64), "gamma": np.ones(37, np.float32),
              "beta": np.zeros(37, np.float32)}
    return nodes, consts


def test_reductions_on_every_special_value_but_nan():
    """Rows mixing +-inf, subnormals and +-3e38 (one overflow-free 3e38 per sum: a sum of two would overflow
    in an order-dependent way); every reduction against ONNX Runtime."""
    rows = FINITE_OR_INF.copy()
    rows[rows == np.float32(-3e38)] = 5.0
    rows[:, 20:] = np.where(np.abs(rows[:, 20:]) > 1e30, 4.0, rows[:, 20:])
    rows[1] = np.where(np.isinf(rows[1]), 3.0, rows[1])  # one row with finite values only
    rows[2] = -INF                                       # all -inf: max -inf, softmax NaN, logsumexp -inf
    nodes, consts = _row_model("x")
    _check_against_ort(_model(nodes, {"x": rows}, consts, opset=18), {"x": rows})


def test_a_nan_makes_its_row_nan_as_in_onnx_runtime():
    """Sums, means, softmax, layer norm: a NaN anywhere in a row makes the row's results NaN."""
    rows = np.random.default_rng(0).standard_normal((5, 37)).astype(np.float32)
    rows[0, 0], rows[1, 17], rows[2, 36], rows[3, 5] = NAN, NAN, NAN, INF
    ops = ["ReduceSum", "ReduceMean", "ReduceL2", "ReduceSumSquare", "ReduceLogSumExp"]
    nodes = [(op, ["x", "axes"], {"keepdims": 1}) for op in ops]
    nodes += [("Softmax", ["x"], {"axis": 1}), ("LogSoftmax", ["x"], {"axis": 1}),
              ("LayerNormalization", ["x", "gamma", "beta"], {"axis": -1})]
    consts = {"axes": np.array([1], np.int64), "gamma": np.ones(37, np.float32), "beta": np.zeros(37, np.float32)}
    _check_against_ort(_model(nodes, {"x": rows}, consts, opset=18), {"x": rows})


def test_the_max_family_propagates_nan_as_numpy_does():
    rows = np.random.default_rng(1).standard_normal((4, 37)).astype(np.float32)
    rows[0, 0], rows[1, 17], rows[2, 36] = NAN, NAN, NAN
    rows[1, 20] = INF
    nodes = [("ReduceMax", ["x", "axes"], {"keepdims": 0}), ("ReduceMin", ["x", "axes"], {"keepdims": 0}),
             ("ArgMax", ["x"], {"axis": 1, "keepdims": 0}), ("ArgMin", ["x"], {"axis": 1, "keepdims": 0}),
             ("Hardmax", ["x"], {"axis": 1}), ("Max", ["x", "zero"], {})]
    model = _model(nodes, {"x": rows}, {"axes": np.array([1], np.int64), "zero": np.float32(0)}, opset=18)
    ours = list(souffle_py.optimize(model, quiet=True).run({"x": rows}).values())
    hard = np.zeros_like(rows)
    hard[np.arange(4), np.argmax(rows, axis=1)] = 1
    for got, expected in zip(ours, [rows.max(1), rows.min(1), rows.argmax(1), rows.argmin(1), hard,
                                    np.maximum(rows, 0)]):
        _assert_same(got, expected.astype(got.dtype), "max family")


def test_pools_match_onnx_runtime_and_propagate_nan():
    """Every special value but NaN against ONNX Runtime; NaN, and a window of -inf only (-inf, where ONNX
    Runtime gives -inf or -3.4e38 by kernel path), against numpy."""
    x = np.random.default_rng(2).standard_normal((1, 3, 9, 9)).astype(np.float32)
    x[0, 1, 0, 0], x[0, 2, 8, 8], x[0, 0, 2, 6], x[0, 1, 7, 1] = INF, -INF, 3e38, 1e-40
    nodes = [("MaxPool", ["x"], {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}),
             ("MaxPool", ["x"], {"kernel_shape": [3, 3], "strides": [3, 3]}),
             ("GlobalMaxPool", ["x"], {}), ("AveragePool", ["x"], {"kernel_shape": [3, 3], "strides": [3, 3]}),
             ("GlobalAveragePool", ["x"], {})]
    model = _model(nodes, {"x": x})
    _check_against_ort(model, {"x": x})
    x[0, 0, 4, 4] = NAN
    x[0, 2, 3:6, 3:6] = -INF
    ours = list(souffle_py.optimize(model, quiet=True).run({"x": x}).values())
    padded = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)), constant_values=-np.inf)
    windows = np.lib.stride_tricks.sliding_window_view(padded, (3, 3), axis=(2, 3))
    _assert_same(ours[0], windows.max(axis=(-1, -2)), "MaxPool with NaN")
    _assert_same(ours[1], x.reshape(1, 3, 3, 3, 3, 3).max(axis=(3, 5)), "strided MaxPool with NaN")
    _assert_same(ours[2], x.max(axis=(2, 3), keepdims=True), "GlobalMaxPool with NaN")
    assert np.isnan(ours[3][0, 0, 1, 1]) and np.isnan(ours[4][0, 0, 0, 0]), "average pools"


def _conv_relu_pool(with_pool: bool) -> onnx.ModelProto:
    rng = np.random.default_rng(3)
    weight = rng.standard_normal((8, 3, 3, 3)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["conv"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["conv"], ["relu"])]
    outputs = ["relu"]
    if with_pool:
        nodes.append(helper.make_node("MaxPool", ["relu"], ["pool"], kernel_shape=[2, 2], strides=[2, 2]))
        outputs = ["pool"]
    graph = helper.make_graph(nodes, "crp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 12, 12])],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT,
                                                             [1, 8] + [6 if with_pool else 12] * 2) for o in outputs],
                              [numpy_helper.from_array(weight, "w"),
                               numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "b")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=IR_VERSION)


def test_conv_relu_maxpool_keeps_a_corrupted_pixel():
    """The issue's model: one NaN and one inf pixel. Conv and ReLU against ONNX Runtime; the pool of
    ONNX Runtime's ReLU output with numpy's NaN-propagating max."""
    x = np.random.default_rng(4).standard_normal((1, 3, 12, 12)).astype(np.float32)
    x[0, 1, 5, 6], x[0, 0, 9, 2] = NAN, INF
    relu = _check_against_ort(_conv_relu_pool(False), {"x": x})["relu"]
    assert np.isnan(relu).sum() == 8 * 9  # the NaN reaches every channel's 3 x 3 neighbourhood
    pooled = souffle_py.optimize(_conv_relu_pool(True), quiet=True).run({"x": x})["pool"]
    reference = OnnxRuntimeModel(_conv_relu_pool(False), threads=1).run({"x": x})["relu"]
    expected = reference.reshape(1, 8, 6, 2, 6, 2).max(axis=(3, 5))
    _assert_same(pooled, expected, "pool")
    assert np.isnan(pooled).any()


def _attention(masked: bool) -> onnx.ModelProto:
    """scores = q k^T / 8, masked with Where(mask, scores, -inf) when `masked`, softmax, times v."""
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["q", "kt"], ["qk"]), helper.make_node("Mul", ["qk", "scale"], ["scores"])]
    last = "scores"
    if masked:
        nodes.append(helper.make_node("Where", ["mask", "scores", "neg_inf"], ["masked"]))
        last = "masked"
    nodes += [helper.make_node("Softmax", [last], ["probs"], axis=-1),
              helper.make_node("MatMul", ["probs", "v"], ["o"])]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 8, 16]) for n in "qkv"]
    if masked:
        inputs.append(helper.make_tensor_value_info("mask", TensorProto.BOOL, [2, 8, 8]))
    graph = helper.make_graph(nodes, "attention", inputs,
                              [helper.make_tensor_value_info("o", TensorProto.FLOAT, [2, 8, 16])],
                              [numpy_helper.from_array(np.float32(0.125), "scale"),
                               numpy_helper.from_array(np.float32(-np.inf), "neg_inf")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=IR_VERSION)


def test_attention_with_nan_inf_and_fully_masked_rows():
    rng = np.random.default_rng(5)
    feeds = {n: rng.standard_normal((2, 8, 16)).astype(np.float32) for n in "qkv"}
    feeds["q"][0, 2, 3] = NAN       # query 2 of batch 0: its row of scores is NaN
    feeds["k"][1, 5, 0] = INF       # key 5 of batch 1: +-inf scores in its column
    feeds["v"][0, 7, 1] = NAN       # value 7: NaN in every output's column 1 that attends to it
    feeds["mask"] = rng.random((2, 8, 8)) > 0.3
    feeds["mask"][1, 4] = False     # a fully masked row: softmax of -inf only is NaN
    _check_against_ort(_attention(True), feeds)
    _check_against_ort(_attention(False), {n: feeds[n] for n in "qkv"})


def test_mlp_with_gelu_on_huge_and_tiny_values():
    rng = np.random.default_rng(6)
    w1, w2 = (rng.standard_normal(s).astype(np.float32) * 0.1 for s in ((37, 64), (64, 37)))
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Gelu", ["h"], ["g"]),
             helper.make_node("MatMul", ["g", "w2"], ["y"]), helper.make_node("Add", ["y", "x"], ["out"])]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5, 37])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [5, 37])],
                              [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=IR_VERSION)
    x = rng.standard_normal((5, 37)).astype(np.float32)
    x[0, 3], x[1, 10], x[2, 20], x[3, 30] = NAN, INF, 1e-40, -3e38
    _check_against_ort(model, {"x": x})


def test_norms_on_special_values():
    """Batch, instance, group, Lp and mean-variance normalization and Mish: NaN and +-inf in some channels,
    subnormals and 3e38 in others, against ONNX Runtime; local response normalization against numpy."""
    x = np.random.default_rng(7).standard_normal((2, 4, 5, 5)).astype(np.float32)
    x[0, 0, 1, 1], x[0, 1, 2, 2], x[1, 2, 0, 0], x[1, 3, 4, 4], x[1, 0, 3, 3] = NAN, INF, -INF, 1e-40, 3e38
    c = 4
    consts = {"scale": np.linspace(0.5, 2, c).astype(np.float32), "bias": np.linspace(-1, 1, c).astype(np.float32),
              "mean": np.zeros(c, np.float32), "var": np.ones(c, np.float32),
              "gscale": np.ones(c, np.float32), "gbias": np.zeros(c, np.float32)}
    nodes = [("BatchNormalization", ["x", "scale", "bias", "mean", "var"], {}),
             ("InstanceNormalization", ["x", "scale", "bias"], {}),
             ("LpNormalization", ["x"], {"axis": 1}), ("MeanVarianceNormalization", ["x"], {"axes": [0, 2, 3]}),
             ("Mish", ["x"], {})]
    _check_against_ort(_model(nodes, {"x": x}, consts, opset=18, same_shape=True), {"x": x})
    # LRN: ONNX Runtime keeps a running sum of squares across channels, so a NaN or inf reaches every later
    # channel (inf - inf); souffle-py sums each window, as the spec and numpy do
    lrn = souffle_py.optimize(_model([("LRN", ["x"], {"size": 3})], {"x": x}, same_shape=True), quiet=True)
    squares = np.pad(x.astype(np.float64) ** 2, ((0, 0), (1, 1), (0, 0), (0, 0)))
    window = squares[:, :-2] + squares[:, 1:-1] + squares[:, 2:]
    expected = (x / (1.0 + 1e-4 / 3 * window) ** 0.75).astype(np.float32)
    _assert_same(lrn.run({"x": x})["lrn_0"], expected, "LRN")
    # GroupNorm (per-channel scale: opset 21) without 3e38, whose square overflows: ONNX Runtime's one-pass
    # variance (E[x^2] - E[x]^2: inf - inf) makes the group NaN there, souffle-py's two-pass one (E[(x - m)^2])
    # inf, so the group 0; both are overflow, neither the real value
    finite = np.where(x == np.float32(3e38), np.float32(5), x)
    group = [("GroupNormalization", ["x", "gscale", "gbias"], {"num_groups": 2})]
    _check_against_ort(_model(group, {"x": finite}, consts, opset=21, same_shape=True), {"x": finite})
