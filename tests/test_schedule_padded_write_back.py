"""schedule/padded_write_back.py: a pad of an intermediate map stored by the write-back that computes the map,
the pad's own nest reduced to its border; pads it cannot take stay as they are."""

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from tvm import te, tirx

import souffle_py
from souffle_py.schedule import padded_write_back
from souffle_py.schedule.default import schedule_cpu
from tests.test_schedule_default import _rand, _run_all


@pytest.fixture(autouse=True)
def _any_size(monkeypatch):
    """Pads of any size taken (the tests' maps are smaller than MIN_PADDED_BYTES)."""
    monkeypatch.setattr(padded_write_back, "MIN_PADDED_BYTES", 0)


def _conv_and_pad(inside=(1, 8), other_reader: bool = False, shortcut: bool = False):
    """A blocked 1x1 conv over 7 x 7 and a pad of it to 9 x 9 carrying a bias and ReLU6, as the frontend
    builds a depthwise conv's input; `inside`: the rows the pad's test lets through (the shifted map's own,
    (1, 8), or fewer); other_reader: the conv's map is also an output of its own; shortcut: the pad adds a map
    computed before the conv (x * 2 + 1, a residual block's shortcut)."""
    x_t = te.placeholder((1, 2, 7, 7, 32), name="x")
    w_t = te.placeholder((2, 64, 1, 1, 32), name="w")
    b_t = te.placeholder((64,), name="b")
    rc, r0, r1 = (te.reduce_axis((0, e), name=n) for n, e in (("rc", 64), ("r0", 1), ("r1", 1)))
    conv = te.compute((1, 2, 7, 7, 32), lambda n, fb, i, j, fi: te.sum(
        x_t[n, rc // 32, i + r0, j + r1, rc % 32] * w_t[fb, rc, r0, r1, fi], axis=[rc, r0, r1]), name="conv")
    skip = te.compute(x_t.shape, lambda *i: x_t(*i) * 2.0 + 1.0, name="skip")
    pad = te.compute((1, 2, 9, 9, 32), lambda n, c, y, x, k: tirx.if_then_else(
        tirx.all(inside[0] <= y, y < inside[1], 1 <= x, x < 8), te.min(te.max(
            (skip[n, c, y - 1, x - 1, k] if shortcut else 0.0) + conv[n, c, y - 1, x - 1, k] + b_t[c * 32 + k], 0.0),
            6.0), 0.0), name="pad")
    outputs = [pad, te.compute(conv.shape, lambda *i: conv(*i) * 2.0, name="twice")] if other_reader else [pad]
    return [x_t, w_t, b_t, *outputs]


def _expected(x, w, b, inside=(1, 8), shortcut: bool = False):
    plain = x.transpose(0, 1, 4, 2, 3).reshape(1, 64, 7, 7)
    conv = np.einsum("fck,nchw->nfhwk", w[:, :, 0, 0, :], plain)
    pad = np.zeros((1, 2, 9, 9, 32), np.float32)
    pad[:, :, 1:8, 1:8] = np.clip(conv + b.reshape(2, 32)[None, :, None, None, :] + (x * 2 + 1 if shortcut else 0),
                                  0, 6)
    pad[:, :, :inside[0]] = 0
    pad[:, :, inside[1]:] = 0
    return conv, pad


@pytest.mark.parametrize("shortcut", [False, True])
def test_a_pad_of_a_conv_output_is_stored_by_the_conv_write_back(shortcut):
    """The pad's value (bias + ReLU6, plus a shortcut map computed before the conv) stored by the conv's
    write-back at the shifted point, the conv's map gone, the pad's nest its border only; every point of
    the output written (NaN-filled before), exact."""
    tensors = _conv_and_pad(shortcut=shortcut)
    script = schedule_cpu(te.create_prim_func(tensors)).script()
    assert 'T.sblock("pad")' not in script and 'T.sblock("pad_border' in script, script
    assert script.count("sblock_alloc_buffer((1, 2, 7, 7, 32))") == shortcut, script  # the shortcut's map
    x, w, b = _rand(1, 2, 7, 7, 32), _rand(2, 64, 1, 1, 32), _rand(64) * 4
    np.testing.assert_allclose(_run_all(tensors, [x, w, b])[0], _expected(x, w, b, shortcut=shortcut)[1],
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", ["other_reader", "narrower_test"])
def test_a_pad_of_a_shared_map_or_a_narrower_test(case):
    """The conv's map read by another block too: the write-back stores both the map and the pad; a test
    letting fewer rows through than the map has (not a plain pad): the pad keeps its nest. Exact."""
    inside = (2, 8) if case == "narrower_test" else (1, 8)
    tensors = _conv_and_pad(inside, other_reader=case == "other_reader")
    script = schedule_cpu(te.create_prim_func(tensors)).script()
    assert ("_border" in script) == (case == "other_reader"), script
    x, w, b = _rand(1, 2, 7, 7, 32), _rand(2, 64, 1, 1, 32), _rand(64) * 4
    conv, pad = _expected(x, w, b, inside)
    got = _run_all(tensors, [x, w, b])
    np.testing.assert_allclose(got[0], pad, rtol=1e-4, atol=1e-4)
    if case == "other_reader":
        np.testing.assert_allclose(got[1], conv * 2, rtol=1e-4, atol=1e-4)


def _inverted_residual(channels: int = 16, expanded: int = 96, size: int = 14):
    """MobileNetV2's inverted residual block: 1x1 expand + ReLU6, 3x3 depthwise (pad 1) + ReLU6, 1x1
    project, the residual add."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.2).astype(np.float32), n) for n, s in (
        ("we", (expanded, channels, 1, 1)), ("be", (expanded,)), ("wd", (expanded, 1, 3, 3)), ("bd", (expanded,)),
        ("wp", (channels, expanded, 1, 1)), ("bp", (channels,)))]
    inits += [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in (("lo", 0.0), ("hi", 6.0))]
    nodes = [helper.make_node("Conv", ["x", "we", "be"], ["e"]), helper.make_node("Clip", ["e", "lo", "hi"], ["er"]),
             helper.make_node("Conv", ["er", "wd", "bd"], ["d"], group=expanded, pads=[1] * 4),
             helper.make_node("Clip", ["d", "lo", "hi"], ["dr"]), helper.make_node("Conv", ["dr", "wp", "bp"], ["p"]),
             helper.make_node("Add", ["p", "x"], ["y"])]
    graph = helper.make_graph(nodes, "inverted_residual", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [1, channels, size, size])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, [1, channels, size, size])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_an_inverted_residual_block_matches_onnx_runtime_with_its_pad_in_the_expand_write_back():
    """The depthwise conv's padded input stored by the expand conv's write-back (a border nest left), the
    block's output as ONNX Runtime's."""
    proto = _inverted_residual()
    model = souffle_py.optimize(proto, quiet=True)
    assert any("_border" in func.script() for func in model.scheduled_functions.values())
    feeds = model.random_feeds()
    expected = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_allclose(next(iter(model.run(feeds).values())), expected, rtol=1e-4, atol=1e-4)


def test_a_pad_smaller_than_the_bound_stays_apart(monkeypatch):
    """A padded map under MIN_PADDED_BYTES stays a pass of its own (it stays in the caches of the cores that
    wrote it): the pad's block as it was, exact."""
    monkeypatch.setattr(padded_write_back, "MIN_PADDED_BYTES", 9 * 9 * 64 * 4 + 1)
    tensors = _conv_and_pad()
    script = schedule_cpu(te.create_prim_func(tensors)).script()
    assert 'T.sblock("pad")' in script and "_border" not in script, script
    x, w, b = _rand(1, 2, 7, 7, 32), _rand(2, 64, 1, 1, 32), _rand(64) * 4
    np.testing.assert_allclose(_run_all(tensors, [x, w, b])[0], _expected(x, w, b)[1], rtol=1e-4, atol=1e-4)
