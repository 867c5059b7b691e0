"""Layouts that would put a gather in every vector lane are not chosen: attention maps after a conv stem
(LeViT), mixed depthwise groups that a channel block does not divide (MixNet), two classifier GEMVs
stacked by the horizontal pass (LeViT's head and distillation head). Values checked against ONNX Runtime."""

import numpy as np
import pytest
from tvm import te

from models.common import GraphBuilder, conv_bn
from souffle_py.backends import backend_for
from souffle_py.frontend import import_onnx
from souffle_py.ir.graph import tensor_loads
from souffle_py.passes import prepared, transformed
from tests.onnx_cases import assert_matches_ort
from test_cpu_target import HASWELL, SPR


def _prepared(model, target="llvm"):
    """The program as the CPU backend compiles it for `target`: TE passes, then the layout passes."""
    return prepared(import_onnx(model), backend_for(target), merge=False)


def _rng_feeds(shape):
    return {"x": np.random.default_rng(1).standard_normal(shape).astype(np.float32)}


def _attention_after_a_conv(heads: int = 16, d: int = 8, size: int = 8):
    """A conv stem, its map as tokens, one attention of `heads` heads: [1, heads, tokens, d] maps."""
    b = GraphBuilder("conv_attention", seed=0)
    x = b.input("x", [1, 16, size, size])
    channels, tokens = heads * d, size * size
    y = b.node("Relu", [conv_bn(b, x, "stem", 16, channels, 3)])
    t = b.node("Transpose", [b.node("Reshape", [y, b.const("flat", np.array([1, channels, tokens]))])], perm=[0, 2, 1])

    def head_split(name, perm):
        p = b.node("MatMul", [t, b.weight(f"{name}/w", [channels, channels])], name=name)
        p = b.node("Reshape", [p, b.const("split", np.array([1, tokens, heads, d]))])
        return b.node("Transpose", [p], perm=perm)
    q, k, v = head_split("q", [0, 2, 1, 3]), head_split("k", [0, 2, 3, 1]), head_split("v", [0, 2, 1, 3])
    p = b.node("Softmax", [b.node("MatMul", [q, k], name="scores")], axis=-1)
    o = b.node("Transpose", [b.node("MatMul", [p, v], name="pv")], perm=[0, 2, 1, 3])
    b.output(b.node("Reshape", [o, b.const("merge", np.array([1, tokens, channels]))]), [1, tokens, channels])
    return b.model(), _rng_feeds([1, 16, size, size])


def _blocked(program):
    return [op for op in program.stages if len(op.axis) == 5]


def test_attention_heads_after_a_conv_stem_stay_out_of_channel_lanes():
    """[1, heads, tokens, d] looks like NCHW to the conv layout; in channel blocks the P.V GEMM would read V
    with 16 heads in the lanes, d floats apart. The stem conv keeps its blocks; the attention does not."""
    model, feeds = _attention_after_a_conv()
    program = _prepared(model)
    names = [op.name for op in _blocked(program)]
    assert any(n.startswith("stem") for n in names), names
    assert not any("pv" in n or "scores" in n or "Softmax" in n for n in names), names
    assert_matches_ort(model, feeds)


def _mixed_depthwise(groups=(12, 12), size: int = 10):
    """MixNet's mixed depthwise conv: a 1x1 expansion split into groups of 12 channels, each group a
    depthwise conv of its own kernel size, concatenated, batch norm + ReLU, a 1x1 projection."""
    b = GraphBuilder("mixed_depthwise", seed=0)
    x = b.input("x", [1, 16, size, size])
    channels = sum(groups)
    y = b.node("Relu", [conv_bn(b, x, "expand", 16, channels, 1)])
    parts = b.node("Split", [y, b.const("sizes", np.array(groups))], axis=1, outputs=len(groups))
    convs = [conv_bn(b, part, f"dw{i}", g, g, 3 + 2 * i, groups=g) for i, (part, g) in enumerate(zip(parts, groups))]
    y = b.node("Relu", [b.node("Concat", convs, axis=1)])
    b.output(conv_bn(b, y, "project", channels, 16, 1), [1, 16, size, size])
    return b.model(), _rng_feeds([1, 16, size, size])


@pytest.mark.parametrize("target", [HASWELL, SPR])
def test_mixed_depthwise_groups_read_no_lane_shifted_blocks(target):
    """12-channel groups in 16-lane blocks: the second group's channel c - 12 is lane l + 4 of another
    block, and a depthwise conv over a map left in NCHW reads its 16 lanes H * W floats apart. No blocked
    TE reads a blocked map at a lane other than its own, nor depends per lane on an NCHW map; the concat
    after the depthwise convs, which would shift the second group's lanes in every vector and choose its
    part lane by lane (MixNet's concat + BN + SiLU over 120 + 120 channels: 1.1 ms), stays NCHW. Under AVX2's
    8 lanes the groups' weights take 4-channel blocks, which small_groups.py densified, reading lanes shifted."""
    model, feeds = _mixed_depthwise()
    program = _prepared(model, target)
    dw = [op for op in program.stages if op.name.startswith("dw") and op.reduce_axis]
    concat = [op for op in program.stages if all(c.output(0) in list(op.input_tensors) for c in dw)]
    assert len(dw) == 2 and len(concat) == 1 and len(concat[0].axis) == 4, [op.name for op in concat]
    for op in _blocked(program):
        lane = op.axis[-1].var
        for load in tensor_loads(op.body[0]):
            indices = list(load.args[1:])
            if len(indices) == 5:
                last = indices[-1]
                assert last.same_as(lane) or not _uses(last, lane), (op.name, load)
            elif len(indices) == 4 and isinstance(load.args[0].op, te.ComputeOp):
                assert not _uses(indices[1], lane), (op.name, load)
    assert_matches_ort(model, feeds)


def _uses(expr, var) -> bool:
    from souffle_py.ir.exprs import uses
    return uses(expr, var)


def _two_classifier_heads(features: int = 64, classes: int = 100):
    """LeViT's head: two batch norms of one pooled feature vector (freshly initialized: equal statistics),
    each a Gemm (weights [N, K], transB), averaged. The horizontal pass stacks the batch norms as two rows
    and the Gemms along their columns, each reading its own row."""
    b = GraphBuilder("two_heads", seed=0)
    x = b.input("x", [1, features, 4, 4])
    pooled = b.node("Flatten", [b.node("GlobalAveragePool", [x])], axis=1)
    outs = []
    stats = [b.const(f"bn_{p}", np.full(features, v, np.float32))
             for p, v in (("gamma", 1), ("beta", 0), ("mean", 0), ("var", 1))]
    for name in ("head", "dist"):
        y = b.node("BatchNormalization", [pooled, *stats], epsilon=1e-5)
        outs.append(b.node("Gemm", [y, b.weight(f"{name}/w", [classes, features]), b.weight(f"{name}/b", [classes])],
                           transB=1))
    y = b.node("Div", [b.node("Add", outs), b.const("two", np.array(2.0, np.float32))])
    b.output(y, [1, classes])
    return b.model(), _rng_feeds([1, features, 4, 4])


def test_stacked_classifier_gemvs_read_their_rows_in_place():
    """The stacked GEMV reads X[j // 100, k]: a [.., k, j] copy of it would repeat each row 100 times
    (LeViT: 768 floats copied into 768,000 per inference); it reads them in place, along k."""
    model, feeds = _two_classifier_heads()
    program = _prepared(model)
    assert not [op.name for op in program.stages if op.name.endswith("_operand_t")]
    assert_matches_ort(model, feeds)


def test_an_elementwise_op_that_gathers_in_either_layout_keeps_the_blocks():
    """A residual add of a blocked map and a flat GEMM output [N, C, H * W] (MobileNetV3's first block)
    gathers one of them whatever its layout: it keeps the blocks. A reduction over the same reads (a GEMM
    reading the flat tensor per term) would gather on every term: it does not."""
    from te_passes.channel_blocks import _gathers_channels

    xb = te.placeholder((1, 2, 8, 8, 16), name="xb")
    flat = te.placeholder((1, 32, 64), name="flat")
    add = te.compute((1, 32, 8, 8), lambda n, c, y, x: xb[n, c // 16, y, x, c % 16] + flat[n, c, y * 8 + x])
    assert not _gathers_channels(add.op, 16)
    k = te.reduce_axis((0, 8), name="k")
    gemm = te.compute((1, 32, 8, 8), lambda n, c, y, x: te.sum(
        xb[n, c // 16, y, k, c % 16] * flat[n, c, k * 8 + x], axis=k))
    assert _gathers_channels(gemm.op, 16)
