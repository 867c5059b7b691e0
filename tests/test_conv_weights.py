"""te_passes/conv_weights.py (the block_conv_weights pass): the frontend's OIHW conv weights blocked by output
channel, [F / B, C / g, *k, B]; before/expected on small programs, values kept, the blocks each target gets."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from tvm import te

from souffle_py import cpu_target
from souffle_py.frontend import import_onnx
from souffle_py.frontend.ops.conv import conv as frontend_conv
from souffle_py.passes import conv_weights_blocked, passes_for
from souffle_py.passes.cuda import CONV_WEIGHT_BLOCKS
from souffle_py.ir.program import TEProgram
from souffle_py.schedule.conv import conv_weight_blocks
from te_passes.check import assert_same_outputs
from te_passes.conv_weights import block_conv_weights, block_of, blocked_array
from te_passes.patterns import conv2d, plain_conv

RNG = np.random.default_rng(0)


def _program(filters=24, channels=8, groups=1, kernel=(3, 3)):
    x = te.placeholder((1, channels, *[6] * len(kernel)), name="x")
    w = te.placeholder((filters, channels // groups, *kernel), name="w")
    out = frontend_conv(x, w, groups, [1] * len(kernel), [1] * len(kernel), [1] * len(kernel), [1] * len(kernel))
    value = RNG.standard_normal([int(d) for d in w.shape]).astype("float32")
    return TEProgram(inputs={"x": x}, params={"w": value}, param_tensors={"w": w}, outputs={"y": out})


def test_the_frontend_emits_onnx_weights_and_the_pass_blocks_them():
    program = _program(filters=24)
    assert plain_conv(program.outputs["y"].op) is not None and conv2d(program.outputs["y"].op) is None
    new, log = block_conv_weights(program, (16, 8))
    assert list(new.params) == ["w_blocked"] and "w by 8" in log.summary()
    blocked = new.params["w_blocked"]
    assert blocked.shape == (3, 8, 3, 3, 8) and blocked.flags["C_CONTIGUOUS"]
    np.testing.assert_array_equal(blocked[1, :, :, :, 2], program.params["w"][1 * 8 + 2])
    found = conv2d(new.outputs["y"].op)
    assert found is not None and found.block == 8 and found.reads_filter_blocks()
    assert plain_conv(new.outputs["y"].op) is None
    assert block_conv_weights(new, (16, 8))[0] is new  # already blocked: nothing to do
    assert_same_outputs(program, new, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("filters,blocks,block", [(32, (16, 8), 16), (24, (16, 8), 8), (12, (16, 8), 12),
                                                  (12, (8, 4), 4), (6, (4,), 6)])
def test_the_first_block_dividing_the_filters_else_all_of_them(filters, blocks, block):
    assert block_of(filters, blocks) == block
    assert blocked_array(np.zeros((filters, 2, 1, 1), "float32"), block).shape == (filters // block, 2, 1, 1, block)


def test_grouped_1d_and_computed_weights():
    grouped = _program(filters=16, channels=16, groups=4)
    assert_same_outputs(grouped, block_conv_weights(grouped, (16, 8))[0], rtol=1e-5, atol=1e-5)
    one_d = _program(filters=8, kernel=(3,))
    new, _ = block_conv_weights(one_d, (16, 8))
    assert new.params["w_blocked"].shape == (1, 8, 3, 8)
    assert_same_outputs(one_d, new, rtol=1e-5, atol=1e-5)
    x = te.placeholder((1, 8, 6, 6), name="x")
    w = te.placeholder((16, 8, 1, 1), name="w")  # a graph input: blocked by a TE as it is read
    out = frontend_conv(x, w, 1, [1, 1], [1, 1], [0, 0], [0, 0])
    computed = TEProgram(inputs={"x": x, "w": w}, params={}, param_tensors={}, outputs={"y": out})
    new, _ = block_conv_weights(computed, (16, 8))
    assert [op.name for op in new.stages] == ["conv_weight_blocks", "conv"]  # no origin: after the conv
    assert_same_outputs(computed, new, rtol=1e-5, atol=1e-5)


def test_computed_weights_are_named_as_the_frontend_named_them_and_other_params_stay():
    """A conv that was its ONNX node's only TE and now reads a blocking TE takes the names the frontend gave
    both when it made the copy itself ({node}_weight_blocks, {node}_conv): a dequantized QDQ weight's."""
    x = te.placeholder((1, 8, 6, 6), name="x")
    w = te.placeholder((16, 8, 1, 1), name="w")
    deq = te.compute((16, 8, 1, 1), lambda *i: w(*i) * 0.5, name="w_DequantizeLinear")
    op = frontend_conv(x, deq, 1, [1, 1], [1, 1], [0, 0], [0, 0]).op
    out = te.ComputeOp("Conv_13", op.tag, op.attrs, op.axis, op.reduce_axis, op.body).output(0)
    unread = np.zeros(3, "float32")
    program = TEProgram(inputs={"x": x}, params={"w": RNG.standard_normal((16, 8, 1, 1)).astype("float32"),
                                                 "zero_point": unread},
                        param_tensors={"w": w, "zero_point": te.placeholder((3,), name="zero_point")},
                        outputs={"y": out}, origins={"Conv_13": "Conv_13", "w_DequantizeLinear": "w/deq"})
    new, _ = block_conv_weights(program, (16, 8))
    assert [op.name for op in new.stages] == ["w_DequantizeLinear", "Conv_13_weight_blocks", "Conv_13_conv"]
    assert new.origins["Conv_13_conv"] == new.origins["Conv_13_weight_blocks"] == "Conv_13"
    assert "Conv_13" not in new.origins and list(new.params) == ["w", "zero_point"]
    assert_same_outputs(program, new, rtol=1e-5, atol=1e-5)


def test_conv_transpose_weight_is_named_after_the_onnx_weight():
    w = numpy_helper.from_array(RNG.standard_normal((8, 16, 3, 3)).astype("float32"), "up_w")
    graph = helper.make_graph([helper.make_node("ConvTranspose", ["x", "up_w"], ["y"], strides=[2, 2])], "up",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 4, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 9, 9])], [w])
    program = import_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8))
    assert list(program.params) == ["up_w"] and program.params["up_w"].shape == (16, 8, 3, 3)
    assert list(conv_weights_blocked(program).params) == ["up_w_blocked"]


def test_blocks_follow_the_cpu_target_and_cuda_keeps_its_own():
    """One vector of float32, else half of one: AVX-512 keeps the frontend's former (16, 8)."""
    for name, blocks in (("avx512", (16, 8)), ("skylake-avx512", (16, 8)), ("avx2", (8, 4)), ("graviton3", (4,))):
        with cpu_target.using(name):
            assert conv_weight_blocks() == blocks, name
    assert CONV_WEIGHT_BLOCKS == (16, 8)
    for device in ("cpu", "cuda"):
        names = [p.name for p in passes_for(device)]
        assert names.index("block_conv_weights") < names.index("vertical") < names.index("horizontal")
    dependent = [p.name for p in passes_for("cpu") if "layout:conv_weight_blocks" in p.requires]
    assert {"widen_weight_blocks", "block_conv_networks", "pad_filters"} <= set(dependent)
