"""schedule/epilogue.py: an elementwise reader of a conv's or a GEMM's output computed in the tile
write-back, including a residual add whose other map the same function computes (TVM's
reverse_compute_inline refuses it; the mark is inlined when the schedule is finished)."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tvm_ffi
from onnx import TensorProto, helper, numpy_helper
from tvm import s_tir, te

import souffle_py
from souffle_py.schedule.default import schedule_cpu
from souffle_py.schedule.epilogue import TILE_EPILOGUE
from tests.test_schedule_default import _rand, _run_all


def _conv_with_residual(shortcut_first: bool):
    """A blocked 1x1 conv, a shortcut map computed in the same function (2x + 1), and relu of their sum: the
    shortcut's nest before the conv's (shortcut_first: the sum reads it first) or after it."""
    x_t = te.placeholder((1, 2, 7, 7, 32), name="x")
    w_t = te.placeholder((2, 64, 1, 1, 32), name="w")
    skip = te.compute(x_t.shape, lambda *i: x_t(*i) * 2.0 + 1.0, name="skip")
    rc, r0, r1 = (te.reduce_axis((0, e), name=n) for n, e in (("rc", 64), ("r0", 1), ("r1", 1)))
    conv = te.compute((1, 2, 7, 7, 32), lambda n, fb, i, j, fi: te.sum(
        x_t[n, rc // 32, i + r0, j + r1, rc % 32] * w_t[fb, rc, r0, r1, fi], axis=[rc, r0, r1]), name="conv")
    relu = te.compute(conv.shape, lambda *i: te.max(skip(*i) + conv(*i) if shortcut_first else conv(*i) + skip(*i),
                                                   0.0), name="relu")
    return [x_t, w_t, relu]


@pytest.mark.parametrize("shortcut_first", [True, False])
def test_a_residual_add_of_a_map_computed_here_runs_in_the_conv_write_back(shortcut_first):
    """relu(conv + shortcut) with the shortcut computed in the function: in the conv's write-back (no block
    and no nest of its own, the mark gone) when the shortcut's nest comes first; a nest of its own when the
    shortcut is computed after the conv (the write-back cannot read it yet). Exact either way."""
    tensors = _conv_with_residual(shortcut_first)
    script = schedule_cpu(te.create_prim_func(tensors)).script()
    assert ('T.sblock("relu")' in script) != shortcut_first, script
    assert TILE_EPILOGUE not in script
    x, w = _rand(1, 2, 7, 7, 32), _rand(2, 64, 1, 1, 32)
    plain = x.transpose(0, 1, 4, 2, 3).reshape(1, 64, 7, 7)
    expected = np.maximum(np.einsum("fck,nchw->nfhwk", w[:, :, 0, 0, :], plain) + x * 2 + 1, 0)
    np.testing.assert_allclose(_run_all(tensors, [x, w])[-1], expected, rtol=1e-4, atol=1e-3)


def test_a_reader_of_part_of_the_map_keeps_its_own_nest():
    """relu(conv + shortcut) over the first 24 of the conv's 32 channels (the others padding): the write-back's
    tiles span all 32, so the reader in it would store past its rows; it stays a nest of its own, exact."""
    x_t = te.placeholder((1, 2, 7, 7, 32), name="x")
    w_t = te.placeholder((2, 64, 1, 1, 32), name="w")
    skip = te.compute((1, 2, 7, 7, 24), lambda *i: x_t(*i) * 2.0 + 1.0, name="skip")
    rc, r0, r1 = (te.reduce_axis((0, e), name=n) for n, e in (("rc", 64), ("r0", 1), ("r1", 1)))
    conv = te.compute((1, 2, 7, 7, 32), lambda n, fb, i, j, fi: te.sum(
        x_t[n, rc // 32, i + r0, j + r1, rc % 32] * w_t[fb, rc, r0, r1, fi], axis=[rc, r0, r1]), name="conv")
    relu = te.compute(skip.shape, lambda *i: te.max(skip(*i) + conv(*i), 0.0), name="relu")
    tensors = [x_t, w_t, relu]
    script = schedule_cpu(te.create_prim_func(tensors)).script()
    assert 'T.sblock("relu' in script, script  # its own blocks (the flat rule's partitions)
    x, w = _rand(1, 2, 7, 7, 32), _rand(2, 64, 1, 1, 32)
    plain = x.transpose(0, 1, 4, 2, 3).reshape(1, 64, 7, 7)
    expected = np.maximum(np.einsum("fck,nchw->nfhwk", w[:, :, 0, 0, :], plain) + x * 2 + 1, 0)[..., :24]
    np.testing.assert_allclose(_run_all(tensors, [x, w])[-1], expected, rtol=1e-4, atol=1e-3)


def test_a_residual_add_after_a_gemm_runs_in_its_write_back():
    """x + (x @ w) with x also scaled in the function first: the add in the GEMM's write-back."""
    a_t = te.placeholder((64, 64), name="a")
    w_t = te.placeholder((64, 64), name="w")
    x_t = te.compute(a_t.shape, lambda i, j: a_t[i, j] * 0.5, name="x")
    r = te.reduce_axis((0, 64), name="r")
    gemm = te.compute((64, 64), lambda i, j: te.sum(x_t[i, r] * w_t[r, j], axis=r), name="gemm")
    out = te.compute(gemm.shape, lambda i, j: gemm[i, j] + x_t[i, j], name="out")
    tensors = [a_t, w_t, out]
    script = schedule_cpu(te.create_prim_func(tensors)).script()
    assert 'T.sblock("out")' not in script, script
    a, w = _rand(64, 64), _rand(64, 64) / 8
    np.testing.assert_allclose(_run_all(tensors, [a, w])[-1], (a / 2) @ w + a / 2, rtol=1e-4, atol=1e-4)


def _bottleneck_onnx(channels: int = 64, size: int = 14) -> onnx.ModelProto:
    """Two ResNet bottleneck-like blocks: the first with a downsample conv on its shortcut (its add reads a
    conv computed after the block's last conv), the second with the identity shortcut."""
    rng = np.random.default_rng(0)
    inits, nodes = [], []

    def conv(name, source, out, k=1):
        w = numpy_helper.from_array((rng.standard_normal((out, channels if source != "x" else 32, k, k)) * 0.1)
                                    .astype(np.float32), f"{name}_w")
        b = numpy_helper.from_array(rng.standard_normal(out).astype(np.float32) * 0.1, f"{name}_b")
        inits.extend([w, b])
        nodes.append(helper.make_node("Conv", [source, w.name, b.name], [name], pads=[k // 2] * 4, name=name))
        return name

    def relu(source):
        nodes.append(helper.make_node("Relu", [source], [f"{source}_r"], name=f"{source}_relu"))
        return f"{source}_r"
    y = relu(conv("a1", "x", channels))
    y = relu(conv("a2", y, channels, 3))
    y = conv("a3", y, channels)
    down = conv("down", "x", channels)
    nodes.append(helper.make_node("Add", [y, down], ["s1"], name="add1"))
    s1 = relu("s1")
    z = relu(conv("b1", s1, channels))
    z = conv("b2", z, channels)
    nodes.append(helper.make_node("Add", [z, s1], ["s2"], name="add2"))
    out = conv("head", relu("s2"), 16)
    graph = helper.make_graph(nodes, "bottleneck", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                                    [1, 32, size, size])],
                              [helper.make_tensor_value_info(out, TensorProto.FLOAT, [1, 16, size, size])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _elementwise_blocks_of_two_maps(func) -> list[str]:
    """The blocks without a reduction that read two or more maps the function computes (a residual add apart;
    a write-back, which reads its accumulator, is not one)."""
    computed = {b.name for b in func.body.block.alloc_buffers if not b.name.endswith("_local")}
    found = []
    tvm_ffi.structural_walk(func.body.block.body, [(s_tir.stmt.SBlock, lambda b: found.append(b.name_hint) if not any(
        int(iv.iter_type) == 2 for iv in b.iter_vars) and len({r.source.name for r in b.reads} & computed) >= 2
        else None)])
    return found


def test_residual_blocks_match_onnx_runtime_with_their_adds_in_write_backs():
    """Bottleneck blocks (one with a downsample shortcut) compiled whole: every residual add + ReLU is in a
    conv's write-back (no mark left, as many nests as convs and pads), and the result matches ONNX Runtime."""
    proto = _bottleneck_onnx()
    model = souffle_py.optimize(proto, quiet=True)
    for func in model.scheduled_functions.values():
        assert TILE_EPILOGUE not in func.script()
        assert not _elementwise_blocks_of_two_maps(func), func.script()
    feeds = model.random_feeds()
    expected = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    got = next(iter(model.run(feeds).values()))
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
