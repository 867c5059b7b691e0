"""The vision and activation rules (conv, pool, normalization, pad/tile, activations, variadic, Einsum) against
ONNX Runtime on random inputs. Tolerance: onnx_cases.RTOL/ATOL (float32, about 1e-4 relative)."""

import numpy as np
import onnx
import pytest
from onnx import helper
from tvm import s_tir

import souffle_py
from models.common import IR_VERSION
from onnx_cases import RTOL, assert_matches_ort, check_op, single_node_model
from souffle_py.baselines import unfused_tvm
from souffle_py.codegen.unfused import unfused_kernels
from souffle_py.errors import UnsupportedError
from souffle_py.frontend import load_model, lower
from souffle_py.passes import conv_weights_blocked
from souffle_py.schedule.blocks import block_kind
from souffle_py.schedule.default import schedule_cpu

rng = np.random.default_rng(0)


def rand(*shape, positive=False):
    x = rng.standard_normal(shape).astype(np.float32)
    return np.abs(x) + 0.1 if positive else x


# --- Conv ------------------------------------------------------------------------------------------------
CONV_CASES = {
    "plain": ((2, 4, 9, 8), (6, 4, 3, 3), dict()),
    "bias": ((1, 3, 8, 8), (5, 3, 3, 3), dict(pads=[1, 1, 1, 1], bias=True)),
    "grouped": ((1, 8, 7, 7), (12, 4, 3, 3), dict(group=2, pads=[1, 1, 1, 1])),
    "depthwise": ((1, 8, 10, 9), (8, 1, 3, 3), dict(group=8, pads=[1, 1, 1, 1])),
    "depthwise_multiplier": ((1, 4, 8, 8), (8, 1, 5, 5), dict(group=4, pads=[2, 2, 2, 2])),
    "strided": ((1, 3, 11, 10), (4, 3, 3, 3), dict(strides=[2, 2], pads=[1, 1, 1, 1])),
    "strided_depthwise": ((1, 16, 14, 14), (16, 1, 5, 5), dict(group=16, strides=[2, 2], pads=[2, 2, 2, 2])),
    "dilated": ((1, 3, 12, 12), (4, 3, 3, 3), dict(dilations=[2, 3], pads=[2, 3, 2, 3])),
    "asymmetric_pads": ((1, 3, 7, 6), (4, 3, 3, 2), dict(pads=[0, 1, 2, 0])),
    "same_upper": ((1, 3, 9, 8), (4, 3, 4, 4), dict(auto_pad="SAME_UPPER", strides=[2, 2])),
    "same_lower": ((1, 3, 9, 8), (4, 3, 4, 4), dict(auto_pad="SAME_LOWER", strides=[2, 2])),
    "valid": ((1, 3, 9, 8), (4, 3, 3, 3), dict(auto_pad="VALID")),
    "pointwise": ((2, 32, 7, 7), (64, 32, 1, 1), dict(bias=True)),
    "pointwise_strided": ((1, 16, 8, 8), (32, 16, 1, 1), dict(strides=[2, 2])),
    "resnext_grouped": ((1, 64, 14, 14), (64, 4, 3, 3), dict(group=16, pads=[1, 1, 1, 1], strides=[2, 2])),
    "stem": ((1, 3, 32, 32), (16, 3, 7, 7), dict(strides=[2, 2], pads=[3, 3, 3, 3])),
    "1d": ((2, 4, 10), (6, 2, 3), dict(group=2, strides=[2], pads=[1, 0], dilations=[2])),
    "3d": ((1, 2, 5, 6, 4), (3, 2, 2, 3, 2), dict(pads=[1, 0, 1, 0, 1, 0], strides=[1, 2, 1])),
}


@pytest.mark.parametrize("name", CONV_CASES)
def test_conv(name):
    x_shape, w_shape, attrs = CONV_CASES[name]
    attrs = dict(attrs, kernel_shape=list(w_shape[2:]))
    consts = {"w": rand(*w_shape)}
    if attrs.pop("bias", False):
        consts["b"] = rand(w_shape[0])
    check_op("Conv", {"x": rand(*x_shape)}, consts=consts, **attrs)


def test_conv_weight_computed_at_run_time():
    check_op("Conv", {"x": rand(1, 4, 6, 6), "w": rand(6, 2, 3, 3)}, group=2, pads=[1, 1, 1, 1])


CONV_TRANSPOSE_CASES = {
    "plain": ((1, 3, 5, 4), (3, 2, 3, 3), dict()),
    "strided": ((1, 3, 5, 4), (3, 4, 3, 3), dict(strides=[2, 3], pads=[1, 1, 1, 1], output_padding=[1, 2])),
    "grouped_dilated": ((1, 4, 5, 5), (4, 3, 3, 2), dict(group=2, dilations=[2, 1], strides=[2, 2], bias=True)),
    "large_pads": ((1, 2, 6, 6), (2, 3, 3, 3), dict(pads=[3, 2, 3, 2])),
    "output_shape": ((1, 2, 4, 4), (2, 3, 3, 3), dict(strides=[2, 2], output_shape=[9, 8])),
    "same_upper": ((1, 2, 4, 5), (2, 3, 3, 3), dict(strides=[2, 2], auto_pad="SAME_UPPER")),
    "1d": ((2, 3, 7), (3, 2, 4), dict(strides=[3], pads=[1, 2])),
}


@pytest.mark.parametrize("name", CONV_TRANSPOSE_CASES)
def test_conv_transpose(name):
    x_shape, w_shape, attrs = CONV_TRANSPOSE_CASES[name]
    consts = {"w": rand(*w_shape)}
    if attrs.pop("bias", False):
        consts["b"] = rand(w_shape[1] * attrs.get("group", 1))
    check_op("ConvTranspose", {"x": rand(*x_shape)}, consts=consts, **attrs)


# --- pooling ---------------------------------------------------------------------------------------------
POOL_CASES = {
    "resnet_stem": ((1, 4, 16, 16), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    "ceil_mode": ((1, 2, 9, 8), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1)),
    "ceil_mode_no_pads": ((1, 2, 7, 7), dict(kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1)),
    "asymmetric": ((1, 2, 9, 8), dict(kernel_shape=[3, 2], strides=[1, 2], pads=[0, 1, 2, 0])),
    "dilated": ((1, 2, 10, 10), dict(kernel_shape=[3, 3], dilations=[2, 2], pads=[2, 2, 2, 2])),
    "same_upper": ((1, 2, 9, 8), dict(kernel_shape=[3, 3], strides=[2, 2], auto_pad="SAME_UPPER")),
    "1d": ((2, 3, 11), dict(kernel_shape=[3], strides=[2], pads=[1, 1])),
    "3d": ((1, 2, 5, 6, 7), dict(kernel_shape=[2, 3, 2], strides=[2, 1, 2], pads=[0, 1, 1, 1, 1, 0])),
}


@pytest.mark.parametrize("name", POOL_CASES)
def test_max_pool(name):
    shape, attrs = POOL_CASES[name]
    check_op("MaxPool", {"x": rand(*shape)}, opset=19, **attrs)


@pytest.mark.parametrize("count_include_pad", [0, 1])
@pytest.mark.parametrize("name", POOL_CASES)
def test_average_pool(name, count_include_pad):
    shape, attrs = POOL_CASES[name]
    check_op("AveragePool", {"x": rand(*shape)}, opset=19, count_include_pad=count_include_pad, **attrs)


def test_ceil_mode_window_in_padding_is_refused():
    """ONNX shape inference keeps a window that ONNX Runtime drops: refuse by name rather than disagree."""
    with pytest.raises(UnsupportedError, match="ceil_mode"):
        check_op("MaxPool", {"x": rand(1, 2, 7, 8)}, kernel_shape=[3, 3], strides=[3, 3], pads=[1, 1, 1, 1],
                 ceil_mode=1)


def test_max_pool_indices_are_refused():
    with pytest.raises(UnsupportedError, match="Indices"):
        check_op("MaxPool", {"x": rand(1, 2, 4, 4)}, outputs=2, kernel_shape=[2, 2])


@pytest.mark.parametrize("op", ["GlobalAveragePool", "GlobalMaxPool"])
@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (1, 4, 6), (1, 2, 3, 4, 5)])
def test_global_pool(op, shape):
    check_op(op, {"x": rand(*shape)})


# --- normalization ---------------------------------------------------------------------------------------
def _bn_params(channels):
    return {"scale": rand(channels), "bias": rand(channels), "mean": rand(channels),
            "var": rand(channels, positive=True)}


@pytest.mark.parametrize("shape", [(2, 3, 5, 4), (2, 3), (1, 4, 3, 2, 2)])
def test_batch_norm_constant_statistics(shape):
    check_op("BatchNormalization", {"x": rand(*shape)}, consts=_bn_params(shape[1]), epsilon=1e-3)


def test_batch_norm_run_time_statistics():
    check_op("BatchNormalization", {"x": rand(2, 3, 4, 4), **_bn_params(3)})


def test_batch_norm_training_mode_is_refused():
    with pytest.raises(UnsupportedError, match="training"):
        check_op("BatchNormalization", {"x": rand(2, 3, 4)}, consts=_bn_params(3), training_mode=1, outputs=3)


def test_instance_norm():
    check_op("InstanceNormalization", {"x": rand(2, 3, 5, 6)}, consts={"s": rand(3), "b": rand(3)}, epsilon=1e-4)


# --- activations -----------------------------------------------------------------------------------------
ACTIVATIONS = [
    ("LeakyRelu", {}), ("LeakyRelu", dict(alpha=0.3)), ("Elu", dict(alpha=0.7)), ("Selu", {}),
    ("Celu", dict(alpha=1.5)), ("ThresholdedRelu", dict(alpha=0.4)), ("HardSigmoid", {}),
    ("HardSigmoid", dict(alpha=0.3, beta=0.4)), ("HardSwish", {}), ("Softplus", {}), ("Softsign", {}),
    ("Shrink", dict(lambd=0.6, bias=0.2)), ("Sign", {}),
]


@pytest.mark.parametrize("op,attrs", ACTIVATIONS, ids=[f"{op}{attrs}" for op, attrs in ACTIVATIONS])
def test_activation(op, attrs):
    x = rand(3, 4, 5) * 4
    x[0, 0, :3] = 0.0  # the boundaries of the piecewise definitions
    check_op(op, {"x": x}, **attrs)


def test_softplus_large_magnitudes():
    check_op("Softplus", {"x": np.array([-100.0, -20.0, 0.0, 20.0, 100.0], np.float32)})


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu(approximate):
    check_op("Gelu", {"x": rand(4, 6) * 3}, opset=20, approximate=approximate)


@pytest.mark.parametrize("slope_shape", [(3, 4), (4,), (3, 1), (1,)])
def test_prelu(slope_shape):
    check_op("PRelu", {"x": rand(2, 3, 4) * 3}, consts={"slope": rand(*slope_shape)})


def test_prelu_slope_that_does_not_broadcast_is_refused():
    with pytest.raises(UnsupportedError, match="slope"):
        check_op("PRelu", {"x": rand(2, 3, 4)}, consts={"slope": rand(3)})


def test_prelu_run_time_slope():
    check_op("PRelu", {"x": rand(2, 3, 4), "slope": rand(4)})


@pytest.mark.parametrize("bounds", [(-0.5, 0.5), (-0.5, None), (None, 0.7), (None, None)])
def test_clip_inputs(bounds):
    lo, hi = bounds
    consts = {"lo": np.array(lo, np.float32) if lo is not None else None,
              "hi": np.array(hi, np.float32) if hi is not None else None}
    names = ["x"] + [name if value is not None else None for name, value in consts.items()]
    check_op("Clip", {"x": rand(3, 5)}, consts={k: v for k, v in consts.items() if v is not None},
             node_inputs=names)


def test_clip_run_time_bounds():
    check_op("Clip", {"x": rand(3, 5), "lo": np.array([-0.2], np.float32), "hi": np.array([0.3], np.float32)})


def test_clip_attributes_before_opset_11():
    check_op("Clip", {"x": rand(3, 5)}, opset=6, min=-0.3, max=0.4)


def test_clip_integers():
    check_op("Clip", {"x": rng.integers(-10, 10, (4, 4)).astype(np.int64)},
             consts={"lo": np.array(-3, np.int64), "hi": np.array(5, np.int64)})


# --- variadic elementwise --------------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["Min", "Max", "Sum", "Mean"])
def test_variadic(op):
    check_op(op, {"a": rand(2, 3, 4), "b": rand(3, 1), "c": rand(4)})


@pytest.mark.parametrize("op", ["Min", "Max", "Sum", "Mean"])
def test_variadic_single_input_and_constant(op):
    check_op(op, {"a": rand(2, 3)})
    check_op(op, {"a": rand(2, 3)}, consts={"c": np.array(0.25, np.float32)})


@pytest.mark.parametrize("op,fn", [("Add", np.add), ("Mul", np.multiply)])
def test_legacy_broadcast_attribute(op, fn):
    """Opsets < 7 place B's axes from `axis` on (ONNX Runtime no longer runs opset 6, so numpy is the oracle)."""
    a, b = rand(2, 3, 4, 5), rand(3, 4)
    model = single_node_model(op, {"a": a}, consts={"b": b}, opset=6, broadcast=1, axis=1)
    np.testing.assert_allclose(souffle_py.optimize(model).run({"a": a})["y0"], fn(a, b[:, :, None]), rtol=RTOL)
    c = rand(5)
    model = single_node_model(op, {"a": a, "c": c}, opset=6, broadcast=1)
    np.testing.assert_allclose(souffle_py.optimize(model).run({"a": a, "c": c})["y0"], fn(a, c), rtol=RTOL)


# --- reductions ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["ReduceMax", "ReduceMin"])
@pytest.mark.parametrize("axes,keepdims", [([1], 1), ([0, 2], 0), ([-1], 0)])
def test_reduce_max_min(op, axes, keepdims):
    check_op(op, {"x": rand(3, 4, 5)}, opset=13, axes=axes, keepdims=keepdims)
    check_op(op, {"x": rand(3, 4, 5)}, consts={"axes": np.array(axes, np.int64)}, opset=18, keepdims=keepdims)


@pytest.mark.parametrize("axis", [-1, 1])
def test_log_softmax(axis):
    check_op("LogSoftmax", {"x": rand(3, 4, 5) * 5}, axis=axis)


# --- data movement ---------------------------------------------------------------------------------------
PAD_CASES = {
    "constant": ("constant", [0, 1, 2, 0, 0, 3], 0.5),
    "crop": ("constant", [0, -1, 2, 0, 1, -2], 0.0),
    "reflect": ("reflect", [0, 2, 1, 0, 1, 3], None),
    "edge": ("edge", [1, 0, 3, 0, 2, 1], None),
    "wrap": ("wrap", [0, 2, 1, 0, 3, 2], None),
}


@pytest.mark.parametrize("name", PAD_CASES)
def test_pad(name):
    mode, pads, value = PAD_CASES[name]
    consts = {"pads": np.array(pads, np.int64)}
    if value is not None:
        consts["value"] = np.array(value, np.float32)
    check_op("Pad", {"x": rand(2, 4, 5)}, consts=consts, opset=19, mode=mode)


def test_pad_with_axes():
    check_op("Pad", {"x": rand(2, 4, 5)}, consts={"pads": np.array([1, 2, 3, 0], np.int64),
                                                  "value": np.array(-1.0, np.float32),
                                                  "axes": np.array([2, 0], np.int64)}, opset=18)


def test_pad_attributes_before_opset_11():
    check_op("Pad", {"x": rand(1, 2, 3, 4)}, opset=2, mode="reflect", pads=[0, 0, 1, 2, 0, 0, 2, 1])


def test_tile():
    check_op("Tile", {"x": rand(2, 3, 1)}, consts={"r": np.array([2, 1, 4], np.int64)})


def _model(nodes, inputs, outputs, initializers=(), opset=17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=IR_VERSION)
    return onnx.shape_inference.infer_shapes(model)


def test_shape_constant_of_shape_and_range_are_folded():
    """Shape of a static tensor feeding ConstantOfShape and Range: compile-time values, no kernels."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("ConstantOfShape", ["s"], ["ones"], value=helper.make_tensor("v", 1, [1], [1.5])),
        helper.make_node("Gather", ["s", "last"], ["n"], axis=0),
        helper.make_node("Cast", ["n"], ["nf"], to=onnx.TensorProto.FLOAT),
        helper.make_node("Range", ["zero", "nf", "one"], ["r"]),
        helper.make_node("Add", ["x", "ones"], ["t"]),
        helper.make_node("Mul", ["t", "r"], ["y"]),
    ]
    inits = [helper.make_tensor("last", onnx.TensorProto.INT64, [], [2]),
             helper.make_tensor("zero", 1, [], [0.0]), helper.make_tensor("one", 1, [], [1.0])]
    model = _model(nodes, [helper.make_tensor_value_info("x", 1, [2, 3, 4])],
                   [helper.make_tensor_value_info("y", 1, [2, 3, 4])], inits)
    assert_matches_ort(model, {"x": rand(2, 3, 4)})
    assert unfused_tvm(model).num_kernels == 2  # Add and Mul: the rest is compile-time arithmetic


def test_run_time_shape_is_refused_by_name():
    nodes = [helper.make_node("ConstantOfShape", ["s"], ["y"], name="fill")]
    model = _model(nodes, [helper.make_tensor_value_info("s", onnx.TensorProto.INT64, [2])],
                   [helper.make_tensor_value_info("y", 1, ["d0", "d1"])])
    with pytest.raises(UnsupportedError, match="fill.*run-time value"):
        souffle_py.optimize(model)


# --- Einsum ----------------------------------------------------------------------------------------------
EINSUM_CASES = {
    "batched_matmul": ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
    "attention_scores": ("bhqd,bhkd->bhqk", [(1, 2, 3, 4), (1, 2, 5, 4)]),
    "transpose": ("ij->ji", [(3, 4)]),
    "diagonal": ("ii->i", [(4, 4)]),
    "dot": ("i,i", [(5,), (5,)]),
    "implicit_output": ("ij,jk", [(2, 3), (3, 4)]),
    "ellipsis_broadcast": ("...ij,...jk->...ik", [(2, 1, 3, 4), (1, 5, 4, 2)]),
    "ellipsis_trailing": ("b...,b...->b...", [(2, 3, 4), (2, 1, 4)]),
    "three_operands": ("ij,jk,kl->il", [(2, 3), (3, 4), (4, 2)]),
    "sum_all": ("ijk->", [(2, 3, 4)]),
}


@pytest.mark.parametrize("name", EINSUM_CASES)
def test_einsum(name):
    equation, shapes = EINSUM_CASES[name]
    check_op("Einsum", {f"x{i}": rand(*s) for i, s in enumerate(shapes)}, equation=equation)



# --- default CPU schedules of the conv stages ------------------------------------------------------------
@pytest.mark.parametrize("name", ["plain", "grouped", "depthwise", "strided_depthwise", "pointwise", "resnext_grouped",
                                  "stem", "1d", "3d"])
def test_conv_stages_get_vectorized_schedules(name):
    """Each conv TE is a 'conv' block and gets a vectorized inner loop; its padding is a 'pad' block."""
    x_shape, w_shape, attrs = CONV_CASES[name]
    attrs = {k: v for k, v in dict(attrs, kernel_shape=list(w_shape[2:])).items() if k != "bias"}
    model = single_node_model("Conv", {"x": rand(*x_shape)}, consts={"w": rand(*w_shape)}, **attrs)
    for kernel in unfused_kernels(conv_weights_blocked(lower(load_model(model)))):  # as block_conv_weights leaves it
        sch = s_tir.Schedule(kernel.func)
        kind = block_kind(sch, sch.get_child_blocks(sch.get_sblock("root"))[0])
        assert kind in ("conv", "pad")
        if kind == "conv":
            assert "T.vectorized" in schedule_cpu(kernel.func).script()
