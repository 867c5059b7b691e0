"""Each lowering rule against ONNX Runtime on random inputs (broadcasting, negative axes, opset forms)."""

import numpy as np
import pytest

from onnx_cases import check_op

rng = np.random.default_rng(0)


def rand(*shape, dtype=np.float32, positive=False):
    x = rng.standard_normal(shape).astype(dtype)
    return np.abs(x) + 0.1 if positive else x


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div"])
@pytest.mark.parametrize("a_shape,b_shape", [((2, 3, 4), (4,)), ((2, 1, 4), (3, 1)), ((3,), (2, 3)),
                                             ((2, 3), (2, 3))])
def test_binary_broadcasting(op, a_shape, b_shape):
    b = rand(*b_shape, positive=(op == "Div"))
    check_op(op, {"a": rand(*a_shape), "b": b})


@pytest.mark.parametrize("const_shape", [(), (1,), (1, 1, 1)])
def test_binary_scalar_constant_is_inlined_with_broadcast_rank(const_shape):
    check_op("Mul", {"a": rand(2, 3)}, consts={"c": np.full(const_shape, 1.5, np.float32)})


@pytest.mark.parametrize("exponent", [2.0, 0.5, 3.0, 1.7])
def test_pow_constant_exponent(exponent):
    check_op("Pow", {"a": rand(3, 4, positive=True)}, consts={"e": np.array(exponent, np.float32)})


def test_pow_tensor_exponent():
    check_op("Pow", {"a": rand(3, 4, positive=True), "e": rand(4)})


@pytest.mark.parametrize("op", ["Erf", "Tanh", "Sigmoid", "Relu", "Exp", "Abs", "Neg", "Floor", "Ceil"])
def test_unary(op):
    check_op(op, {"x": rand(2, 3, 5) * 2})


@pytest.mark.parametrize("op", ["Sqrt", "Log", "Reciprocal"])
def test_unary_positive_domain(op):
    check_op(op, {"x": rand(4, 5, positive=True)})


@pytest.mark.parametrize("op", ["Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual"])
def test_comparisons(op):
    a = rng.integers(0, 3, (2, 3)).astype(np.float32)
    check_op(op, {"a": a, "b": rng.integers(0, 3, (3,)).astype(np.float32)})


def test_logic_and_where():
    c = rng.integers(0, 2, (2, 3)).astype(bool)
    check_op("And", {"a": c, "b": rng.integers(0, 2, (3,)).astype(bool)})
    check_op("Not", {"a": c})
    check_op("Where", {"c": c, "x": rand(3), "y": rand(2, 1)})


@pytest.mark.parametrize("to,src", [(7, np.float32), (1, np.int64), (9, np.float32), (1, np.bool_)])
def test_cast(to, src):
    x = (rand(3, 4) * 3).astype(src) if src != np.bool_ else rng.integers(0, 2, (3, 4)).astype(bool)
    check_op("Cast", {"x": x}, to=to)


@pytest.mark.parametrize("axis,opset", [(-1, 13), (1, 13), (1, 11), (0, 11)])
def test_softmax(axis, opset):
    check_op("Softmax", {"x": rand(2, 3, 4) * 3}, opset=opset, axis=axis)


def test_softmax_of_rows_with_minus_infinity():
    """The row max starts from the lowest finite value (what GPU warp reductions recognize): a masked
    element still gives 0 and a row of -inf NaN, as in ONNX Runtime."""
    x = rand(3, 5).astype(np.float32)
    x[1, :] = -np.inf
    x[2, 2] = -np.inf
    check_op("Softmax", {"x": x}, axis=1)


@pytest.mark.parametrize("op", ["ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd"])
@pytest.mark.parametrize("axes,keepdims", [([-1], 1), ([0, 2], 0), (None, 1)])
def test_reduce_attribute_axes(op, axes, keepdims):
    attrs = {"keepdims": keepdims} | ({"axes": axes} if axes is not None else {})
    check_op(op, {"x": rand(2, 3, 4)}, opset=13, **attrs)


@pytest.mark.parametrize("op,opset", [("ReduceSum", 13), ("ReduceMean", 18), ("ReduceMax", 18)])
def test_reduce_input_axes(op, opset):
    check_op(op, {"x": rand(2, 3, 4)}, consts={"axes": np.array([1, -1], np.int64)}, opset=opset, keepdims=0)


def test_reduce_noop_with_empty_axes():
    check_op("ReduceSum", {"x": rand(2, 3)}, opset=13, noop_with_empty_axes=1)


@pytest.mark.parametrize("a_shape,b_shape", [((3, 4), (4, 5)), ((2, 1, 3, 4), (5, 4, 6)), ((4,), (4, 5)),
                                             ((3, 4), (4,)), ((2, 3, 4), (4, 5))])
def test_matmul(a_shape, b_shape):
    check_op("MatMul", {"a": rand(*a_shape), "b": rand(*b_shape)})


@pytest.mark.parametrize("trans_a,trans_b,alpha,beta,c_shape", [(0, 0, 1.0, 1.0, None), (1, 0, 0.5, 1.0, (5,)),
                                                                (0, 1, 1.0, 2.0, (3, 5)), (1, 1, 2.0, 0.5, (1, 5))])
def test_gemm(trans_a, trans_b, alpha, beta, c_shape):
    a = rand(4, 3) if trans_a else rand(3, 4)
    b = rand(5, 4) if trans_b else rand(4, 5)
    consts = {"c": rand(*c_shape)} if c_shape else {}
    check_op("Gemm", {"a": a, "b": b}, consts=consts, transA=trans_a, transB=trans_b, alpha=alpha, beta=beta)


@pytest.mark.parametrize("axis", [-1, -2])
def test_layer_normalization(axis):
    check_op("LayerNormalization", {"x": rand(2, 3, 8)}, consts={"g": rand(*(3, 8)[axis:]), "b": rand(8)},
             axis=axis, epsilon=1e-5)


@pytest.mark.parametrize("shape", [[0, -1], [6, 4], [2, 3, 2, 2], [-1]])
def test_reshape(shape):
    check_op("Reshape", {"x": rand(2, 3, 4)}, consts={"s": np.array(shape, np.int64)})


@pytest.mark.parametrize("perm", [None, [0, 2, 1, 3], [3, 1, 0, 2]])
def test_transpose(perm):
    check_op("Transpose", {"x": rand(2, 3, 4, 5)}, **({"perm": perm} if perm else {}))


def test_unsqueeze_squeeze_both_opset_forms():
    check_op("Unsqueeze", {"x": rand(2, 3)}, opset=11, axes=[0, -1])
    check_op("Unsqueeze", {"x": rand(2, 3)}, consts={"axes": np.array([1, -1], np.int64)}, opset=13)
    check_op("Squeeze", {"x": rand(1, 3, 1)}, opset=11, axes=[-1])
    check_op("Squeeze", {"x": rand(1, 3, 1)}, consts={"axes": np.array([0], np.int64)}, opset=13)
    check_op("Squeeze", {"x": rand(1, 3, 1)}, opset=13)


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_flatten(axis):
    check_op("Flatten", {"x": rand(2, 3, 4)}, axis=axis)


def test_concat_negative_axis_with_constant_input():
    check_op("Concat", {"a": rand(2, 3), "b": rand(2, 1)}, consts={"c": rand(2, 2)}, axis=-1)


@pytest.mark.parametrize("starts,ends,axes,steps", [([1], [3], [0], [1]), ([-3, 0], [100, -1], [2, 1], [1, 2]),
                                                    ([4], [-100], [2], [-2]), ([0], [2], None, None)])
def test_slice(starts, ends, axes, steps):
    consts = {"s": np.array(starts, np.int64), "e": np.array(ends, np.int64)}
    if axes is not None:
        consts |= {"a": np.array(axes, np.int64), "st": np.array(steps, np.int64)}
    check_op("Slice", {"x": rand(4, 5, 6)}, consts=consts)


def test_slice_opset9_attributes():
    check_op("Slice", {"x": rand(4, 5)}, opset=9, starts=[1, -3], ends=[3, 100], axes=[0, 1])


def test_split_forms():
    check_op("Split", {"x": rand(6, 4)}, outputs=3, axis=0)
    check_op("Split", {"x": rand(2, 7)}, outputs=2, consts={"s": np.array([3, 4], np.int64)}, axis=-1)
    check_op("Split", {"x": rand(2, 7)}, outputs=2, opset=11, axis=1, split=[2, 5])
    check_op("Split", {"x": rand(7, 2)}, outputs=3, opset=18, axis=0, num_outputs=3)


def test_gather_constant_indices():
    check_op("Gather", {"x": rand(5, 4)}, consts={"i": np.array(-2, np.int64)}, axis=0)
    check_op("Gather", {"x": rand(3, 5, 2)}, consts={"i": np.array([[0, -1], [4, 2]], np.int64)}, axis=1)


def test_gather_runtime_indices_with_negatives():
    check_op("Gather", {"x": rand(6, 3), "i": np.array([0, -1, 3, -6], np.int64)}, axis=0)


def test_expand_and_identity():
    check_op("Expand", {"x": rand(3, 1)}, consts={"s": np.array([2, 1, 4], np.int64)})
    check_op("Identity", {"x": rand(2, 2)})


def test_shape_arithmetic_is_folded_at_compile_time():
    """Shape -> Reshape: the target shape comes from another tensor's shape, known at compile time."""
    import onnx
    from onnx import helper

    from models.common import IR_VERSION
    from onnx_cases import assert_matches_ort

    nodes = [helper.make_node("Shape", ["y"], ["s"]), helper.make_node("Reshape", ["x", "s"], ["out"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", 1, [2, 6]),
                                           helper.make_tensor_value_info("y", 1, [3, 4])],
                              [helper.make_tensor_value_info("out", 1, [3, 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=IR_VERSION)
    onnx.checker.check_model(model)
    assert_matches_ort(model, {"x": rand(2, 6), "y": rand(3, 4)})


@pytest.mark.parametrize("indices,reduction", [
    (np.arange(1, 6).reshape(5, 1), "none"),          # x[1:6] = y, as the dynamo exporter writes it
    (np.arange(0, 6, 2).reshape(3, 1), "add"),        # every other row
    (np.array([[[2, 1], [0, 3]], [[-1, 0], [4, 2]]]), "none"),  # single elements, a negative index
    (np.array([[5], [0], [3]]), "max")])
def test_scatter_nd_at_constant_indices(indices, reduction):
    data = rand(6, 4, 3)
    updates = rand(*indices.shape[:-1], *data.shape[indices.shape[-1]:])
    check_op("ScatterND", {"data": data, "updates": updates}, consts={"indices": indices.astype(np.int64)},
             reduction=reduction, node_inputs=["data", "indices", "updates"])


@pytest.mark.parametrize("axis,reduction", [(1, "none"), (0, "add"), (-1, "min")])
def test_scatter_elements_at_constant_indices(axis, reduction):
    """torch's scatter / scatter_add over compile-time indices, repeated ones combined in order."""
    data, indices = rand(4, 5), rng.integers(-4, 4, (3, 4)).astype(np.int64)
    check_op("ScatterElements", {"data": data, "updates": rand(3, 4)}, consts={"indices": indices}, axis=axis,
             reduction=reduction, node_inputs=["data", "indices", "updates"], opset=18)


def test_gather_elements_over_constants_of_many_rows_is_folded():
    """Funnel's relative-position embeddings: GatherElements over 64 rows of a constant table, which onnx's
    reference evaluator cannot fold (np.choose takes at most 32 choices). Folded with numpy, the einsum over
    it folds too: the program keeps only the einsum over the input, and matches ONNX Runtime."""
    from onnx import helper, numpy_helper

    from models.common import IR_VERSION
    from onnx_cases import assert_matches_ort
    from souffle_py.frontend.lower import lower

    rng = np.random.default_rng(0)
    table = numpy_helper.from_array(rng.standard_normal((64, 8)).astype(np.float32), "table")
    index = numpy_helper.from_array(rng.integers(-64, 64, (48, 8)).astype(np.int64), "index")
    weight = numpy_helper.from_array(rng.standard_normal((8, 2, 4)).astype(np.float32), "weight")
    nodes = [helper.make_node("GatherElements", ["table", "index"], ["pos"], axis=0),
             helper.make_node("Einsum", ["pos", "weight"], ["proj"], equation="td,dnh->tnh"),
             helper.make_node("Einsum", ["x", "proj"], ["out"], equation="bnh,tnh->bnt")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", 1, [3, 2, 4])],
                              [helper.make_tensor_value_info("out", 1, [3, 2, 48])], [table, index, weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=IR_VERSION)
    assert len(lower(model).stages) == 1
    assert_matches_ort(model, {"x": rand(3, 2, 4)})


def test_subnormal_constants_become_zero():
    """ConViT's folded positional attention softmax(pos_proj(rel)) is 9% subnormal, and an FMA with a
    subnormal operand takes a microcode assist on Intel cores (its mixing stage 4x slower). The folded
    constant's subnormals become zero (the CPU pass flush_subnormal_params); normal values and zeros are kept,
    and ONNX Runtime still agrees."""
    from onnx import helper, numpy_helper

    from models.common import IR_VERSION
    from onnx_cases import assert_matches_ort
    from souffle_py.frontend.lower import lower

    logits = np.array([[0.0, -100.0, -95.0, 1.0], [-90.0, 2.0, 0.5, -104.0]], np.float32)
    nodes = [helper.make_node("Softmax", ["logits"], ["pos"], axis=-1),
             helper.make_node("Mul", ["x", "g"], ["gx"]), helper.make_node("Add", ["gx", "pos"], ["out"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", 1, [2, 4])],
                              [helper.make_tensor_value_info("out", 1, [2, 4])],
                              [numpy_helper.from_array(logits, "logits"),
                               numpy_helper.from_array(np.array(0.5, np.float32), "g")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=IR_VERSION)
    e = np.exp(logits - logits.max(-1, keepdims=True))
    folded = e / e.sum(-1, keepdims=True)
    tiny = np.finfo(np.float32).tiny
    assert ((folded != 0) & (np.abs(folded) < tiny)).sum() >= 2  # the case has subnormals to flush
    from te_passes.subnormals import flush_subnormal_params

    params = [v for v in flush_subnormal_params(lower(model))[0].params.values() if v.shape == (2, 4)]
    assert len(params) == 1
    value = params[0]
    assert not ((value != 0) & (np.abs(value) < tiny)).any()
    normal = np.abs(folded) >= tiny
    np.testing.assert_allclose(value[normal], folded[normal], rtol=1e-6)
    assert_matches_ort(model, {"x": rand(2, 4)})


@pytest.mark.parametrize("with_bias,with_state", [(True, True), (False, False), (True, False)])
def test_lstm(with_bias, with_state):
    steps, batch, inp, hidden = 4, 2, 3, 5
    consts = {"W": rand(1, 4 * hidden, inp), "R": rand(1, 4 * hidden, hidden) * 0.5}
    inputs = {"X": rand(steps, batch, inp)}
    names = ["X", "W", "R", "B" if with_bias else None, None]
    if with_bias:
        consts["B"] = rand(1, 8 * hidden) * 0.1
    if with_state:
        inputs |= {"h0": rand(1, batch, hidden), "c0": rand(1, batch, hidden)}
        names += ["h0", "c0"]
    check_op("LSTM", inputs, outputs=3, consts=consts, hidden_size=hidden, node_inputs=names)


def test_a_weight_shared_by_two_convs_is_one_parameter():
    """Both convs read the same blocked weight: blocking it per conv would store (and stream) it twice."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from onnx_cases import assert_matches_ort
    from souffle_py.frontend import import_onnx
    from souffle_py.passes import conv_weights_blocked

    w = numpy_helper.from_array(rand(16, 16, 3, 3) / 12, "w")  # outputs of the size of the inputs
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1]),
         helper.make_node("Conv", ["y", "w"], ["z"], pads=[1, 1, 1, 1])], "shared",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 6, 6])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 16, 6, 6])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    program = import_onnx(model)  # the ONNX weight as it is; block_conv_weights blocks it once for both
    assert [name for name in program.params if name.startswith("w")] == ["w"]
    assert [name for name in conv_weights_blocked(program).params if name.startswith("w")] == ["w_blocked"]
    assert_matches_ort(model, {"x": rand(1, 16, 6, 6)})
