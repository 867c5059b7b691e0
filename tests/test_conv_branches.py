"""souffle_py/frontend/conv_branches.py: sums of convolution branches of one input folded into one Conv
(RepVGG, MobileOne, ACNet blocks), values checked against ONNX Runtime; branches that do not align stay."""

import collections

import numpy as np
import pytest

from models.common import GraphBuilder
from souffle_py.frontend.conv_branches import fold_conv_branches
from souffle_py.frontend.loader import load_model
from tests.onnx_cases import assert_matches_ort

C, SIZE = 16, 8


def _conv(b, x, name, kernel, pads, stride=1, group=1, cout=C, bias=True):
    kh, kw = kernel
    inputs = [x, b.weight(f"{name}/w", [cout, C // group, kh, kw])] + ([b.weight(f"{name}/b", [cout], 0.1)] if bias else [])
    return b.node("Conv", inputs, name=name, kernel_shape=[kh, kw], pads=pads, strides=[stride, stride], group=group)


def _norm(b, x, name):
    stats = [b.const(f"{name}/{p}", v.astype(np.float32)) for p, v in (
        ("gamma", 1 + 0.1 * np.arange(C)), ("beta", 0.01 * np.arange(C)), ("mean", 0.02 * np.arange(C)),
        ("var", 1 + 0.05 * np.arange(C)))]
    return b.node("BatchNormalization", [x, *stats], name=name, epsilon=1e-5)


def _model(branches, size=SIZE, first_read_twice=False):
    b = GraphBuilder("branches", seed=0, opset=17)
    x = b.input("x", [1, C, SIZE, SIZE])
    outs = [make(b, x) for make in branches]
    y = outs[0]
    for other in outs[1:]:
        y = b.node("Add", [y, other])
    b.output(b.node("Relu", [y]), [1, C, size, size])
    if first_read_twice:  # the first branch's output is also a model output
        b.output(outs[0], [1, C, size, size])
    return b.model(), {"x": np.random.default_rng(5).standard_normal((1, C, SIZE, SIZE)).astype(np.float32)}


def _ops(model):
    return collections.Counter(n.op_type for n in fold_conv_branches(load_model(model)).graph.node)


REPVGG = [lambda b, x: _conv(b, x, "k3", (3, 3), [1, 1, 1, 1]), lambda b, x: _conv(b, x, "k1", (1, 1), [0, 0, 0, 0]),
          lambda b, x: _norm(b, x, "identity")]
MOBILEONE_DW = [lambda b, x: _conv(b, x, f"dw{i}", (3, 3), [1, 1, 1, 1], group=C, bias=False) for i in range(3)] + [
    lambda b, x: _conv(b, x, "scale", (1, 1), [0, 0, 0, 0], group=C), lambda b, x: _norm(b, x, "identity")]
ACNET = [lambda b, x: _conv(b, x, "k33", (3, 3), [1, 1, 1, 1]), lambda b, x: _conv(b, x, "k13", (1, 3), [0, 1, 0, 1]),
         lambda b, x: _conv(b, x, "k31", (3, 1), [1, 0, 1, 0])]


@pytest.mark.parametrize("branches", [REPVGG, MOBILEONE_DW, ACNET], ids=["repvgg", "mobileone_dw", "acnet"])
def test_branches_of_one_input_fold_into_one_conv_and_match_onnx_runtime(branches):
    model, feeds = _model(branches)
    ops = _ops(model)
    assert ops["Conv"] == 1 and ops["Add"] == 0 and ops["BatchNormalization"] == 0, ops
    assert_matches_ort(model, feeds, rtol=1e-4, atol=1e-4)


def test_a_constant_added_to_a_conv_joins_its_bias():
    b = GraphBuilder("bias_apart", seed=0, opset=17)
    x = b.input("x", [1, C, SIZE, SIZE])
    y = _conv(b, x, "c", (3, 3), [1, 1, 1, 1], bias=False)
    y = b.node("Add", [y, b.const("shift", np.linspace(-1, 1, C, dtype=np.float32).reshape(1, C, 1, 1))])
    y = b.node("Add", [y, b.const("one", np.float32(1.0))])
    b.output(y, [1, C, SIZE, SIZE])
    ops = _ops(b.model())
    assert ops["Add"] == 0 and ops["Conv"] == 1
    assert_matches_ort(b.model(), {"x": np.ones((1, C, SIZE, SIZE), np.float32)}, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", ["strides", "read_twice", "two_norms"])
def test_branches_that_do_not_align_stay_apart(case):
    if case == "strides":  # a strided 3x3 and a strided 1x1 with their own pads: windows centred differently
        branches = [lambda b, x: _conv(b, x, "k3", (3, 3), [1, 1, 1, 1], stride=2),
                    lambda b, x: _conv(b, x, "k1", (2, 2), [0, 0, 0, 0], stride=2)]
    elif case == "two_norms":
        branches = [lambda b, x: _norm(b, x, "n1"), lambda b, x: _norm(b, x, "n2")]
    else:
        branches = REPVGG[:2]
    model, feeds = _model(branches, size=SIZE // 2 if case == "strides" else SIZE, first_read_twice=case == "read_twice")
    ops = _ops(model)
    assert ops["Add"] >= 1, ops
    assert_matches_ort(model, feeds, rtol=1e-4, atol=1e-4)
