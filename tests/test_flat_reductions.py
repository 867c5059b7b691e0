"""te_passes/flat_reductions.py: sums over a reshaped map reduce over its factors."""

import numpy as np

from models.common import GraphBuilder
from souffle_py.frontend import import_onnx
from te_passes.check import assert_same_outputs
from te_passes.flat_reductions import split_flat_reductions
from souffle_py.passes import transformed
from tests.onnx_cases import assert_matches_ort


def _group_norm_one_group(channels: int = 16, size: int = 16):
    """timm's GroupNorm(1, C) as exported: a per-channel add, a reshape to [1, 1, C * H * W],
    InstanceNormalization over it, the reshape back, then a 1x1 conv (a contraction that must stay as it is)."""
    b = GraphBuilder("gn1", seed=0, opset=17)
    x = b.input("x", [1, channels, size, size])
    y = b.node("Add", [x, b.weight("shift", [1, channels, 1, 1], 1.0)])
    flat = b.node("Reshape", [y, b.const("flat", np.array([1, 1, -1], np.int64))])
    normed = b.node("InstanceNormalization", [flat, b.const("scale", np.ones(1, np.float32)),
                                              b.const("bias", np.zeros(1, np.float32))], epsilon=1e-5)
    y = b.node("Reshape", [normed, b.const("back", np.array([1, channels, size, size], np.int64))])
    y = b.node("Conv", [y, b.weight("w", [channels, channels, 1, 1], 0.3)], kernel_shape=[1, 1])
    b.output(y, [1, channels, size, size])
    return b.model(), {"x": np.random.default_rng(2).standard_normal((1, channels, size, size)).astype(np.float32)}


def test_statistics_over_a_reshaped_map_sum_over_channels_and_points():
    model, feeds = _group_norm_one_group()
    program, _ = transformed(import_onnx(model))
    split = split_flat_reductions(program)
    before = {op.name: op for op in program.stages}
    after = {op.name: op for op in split.stages}
    # the same TEs: the variance reads the split mean, not a second copy of the old one
    assert before.keys() == after.keys() and len(split.stages) == len(program.stages)
    changed = [name for name in after if len(after[name].reduce_axis) != len(before[name].reduce_axis)]
    assert len(changed) == 2 and all([int(r.dom.extent) for r in after[name].reduce_axis] == [16, 256] for name in changed)
    assert not any("Conv" in name for name in changed)  # the conv's channel sum keeps its axes
    assert_same_outputs(program, split, feeds=feeds, rtol=1e-4, atol=1e-4)
    assert_matches_ort(model, feeds)


def test_contractions_keep_their_axis():
    """A GEMV over 2048 terms read in 32-channel blocks (x[k // 32, k % 32] . w[k]): the GEMM schedules own it."""
    from tvm import te

    from souffle_py.ir.program import TEProgram
    x, w = te.placeholder((64, 32), name="x"), te.placeholder((2048,), name="w")
    k = te.reduce_axis((0, 2048), name="k")
    y = te.compute((1,), lambda i: te.sum(x[k // 32, k % 32] * w[k], axis=k), name="y")
    program = TEProgram(inputs={"x": x, "w": w}, params={}, param_tensors={}, outputs={"y": y})
    assert split_flat_reductions(program) is program
