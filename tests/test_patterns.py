"""The pattern library (te_passes/patterns): each matcher on small TE programs, what it returns and that
what is not its pattern gives None."""

from __future__ import annotations

import numpy as np
import pytest
from tvm import te

from souffle_py.frontend.ops.conv import conv as frontend_conv
from souffle_py.ir.program import TEProgram
from te_passes.patterns import (LAYOUT_RANKS, batch_matmul, conv, conv2d, data_reads_output_channel, gemm,
                                has_rank, in_layout, is_map, matmul, plain_conv, product_reduction, rank, row_reduce)
from souffle_py.ir.marks import MEMBER
from te_passes.conv_weights import block_conv_weights


def _plain_conv(channels=8, filters=16, groups=1, kernel=(3, 3), strides=(1, 1), dilations=(1, 1), pads=(0, 0),
                size=8):
    """The frontend's convolution over an OIHW weight, as a program with the weight a parameter."""
    x = te.placeholder((1, channels, *[size] * len(kernel)), name="x")
    w = te.placeholder((filters, channels // groups, *kernel), name="w")
    out = frontend_conv(x, w, groups, list(strides), list(dilations), list(pads), list(pads))
    value = np.zeros([int(d) for d in w.shape], "float32")
    return TEProgram(inputs={"x": x}, params={"w": value}, param_tensors={"w": w}, outputs={"y": out})


def _conv(block=16, **kwargs):
    """... with its weight blocked by `block` output channels (block_conv_weights): (out, x, blocked w)."""
    program, _ = block_conv_weights(_plain_conv(**kwargs), (block,))
    return program.outputs["y"], program.inputs["x"], program.param_tensors["w_blocked"]


def test_dense_conv2d():
    out, x, w = _conv()
    found = conv2d(out.op)
    assert found is not None
    assert found.data_tensor.same_as(x) and found.weight_tensor.same_as(w)
    assert (found.layout, found.weight_layout) == ("NCHW", "OIHWo")
    assert (found.filters, found.channels, found.group_channels, found.groups, found.block) == (16, 8, 8, 1, 16)
    assert found.kernel == (3, 3) and not found.depthwise and not found.stacked
    assert found.reads_filter_blocks() and not data_reads_output_channel(found)
    assert found.output_channel.same_as(out.op.axis[1].var)


def test_window_reads_strides_dilations_and_padding():
    out, _, _ = _conv(strides=(2, 1), dilations=(1, 2), pads=(1, 1))
    found = conv2d(out.op)  # the pad is a TE of its own: the conv reads it at the origin
    window = found.window()
    assert window.strides == (2, 1) and window.dilations == (1, 2) and window.offsets == (0, 0)
    assert found.data_tensor.op.name == "pad"


def test_grouped_and_depthwise():
    grouped, _, _ = _conv(channels=16, filters=16, groups=4)
    found = conv2d(grouped.op)
    assert found.groups == 4 and found.group_channels == 4 and not found.depthwise
    assert data_reads_output_channel(found)
    depthwise, _, _ = _conv(channels=16, filters=16, groups=16)
    found = conv2d(depthwise.op)
    assert found.depthwise and found.groups == 16


def test_conv1d():
    out, x, w = _conv(kernel=(3,), block=8)
    assert conv2d(out.op) is None  # not 2-D
    found = conv(out.op)
    assert (found.layout, found.weight_layout, found.spatial, found.kernel) == ("NCW", "OIWo", 1, (3,))
    assert found.reads_filter_blocks()
    assert found.window().strides == (1,)


def test_plain_conv_is_the_frontends_and_only_it():
    """The frontend's conv over an OIHW weight (before block_conv_weights): the weight read at the output
    channel and the reduction's axes in order; no blocked-form matcher takes it, and a GEMM over a
    transposed weight (W[j, k], two axes) or a batched product is not one."""
    program = _plain_conv(channels=16, filters=16, groups=4, kernel=(3,))
    out = program.outputs["y"]
    found = plain_conv(out.op)
    assert found is not None and found.weight_tensor.same_as(program.param_tensors["w"]) and found.filters == 16
    assert found.data.args[0].same_as(program.inputs["x"])
    assert conv(out.op) is None and conv2d(_plain_conv().outputs["y"].op) is None
    assert plain_conv(_conv()[0].op) is None  # blocked
    a, wt = te.placeholder((4, 8), name="a"), te.placeholder((16, 8), name="wt")
    k = te.reduce_axis((0, 8), "k")
    assert plain_conv(te.compute((4, 16), lambda i, j: te.sum(a[i, k] * wt[j, k], axis=k)).op) is None
    q, kt = te.placeholder((2, 4, 8), name="q"), te.placeholder((2, 6, 8), name="kt")
    assert plain_conv(te.compute((2, 4, 6), lambda b, i, j: te.sum(q[b, i, k] * kt[b, j, k], axis=k)).op) is None


def test_channel_blocked_depthwise():
    """An NCHWc map read at f // 16 and f % 16 beside the weight (conv_layout.block_depthwise_inputs):
    the weight is the read whose first index is the output channel's block."""
    xb = te.placeholder((1, 2, 10, 10, 16), name="xb")
    w = te.placeholder((2, 1, 3, 3, 16), name="w")
    rc, r, s = te.reduce_axis((0, 1), "rc"), te.reduce_axis((0, 3), "r"), te.reduce_axis((0, 3), "s")
    out = te.compute((1, 32, 8, 8), lambda n, f, y, x: te.sum(
        w[f // 16, rc, r, s, f % 16] * xb[n, f // 16, y + r, x + s, f % 16], axis=[rc, r, s]), name="dw")
    found = conv(out.op)
    assert (found.layout, found.weight_layout) == ("NCHWc", "OIHWo")
    assert found.data_tensor.same_as(xb) and found.weight_tensor.same_as(w)
    assert found.channels == 32 and found.depthwise
    assert conv2d(out.op) is None


def test_stacked_weight():
    """horizontal.py's stacked convs: [B, F / b, C, kh, kw, b], the branch the output's first axis."""
    x = te.placeholder((2, 8, 6, 6), name="x")
    w = te.placeholder((2, 1, 8, 1, 1, 16), name="w")
    rc, r, s = te.reduce_axis((0, 8), "rc"), te.reduce_axis((0, 1), "r"), te.reduce_axis((0, 1), "s")
    out = te.compute((2, 16, 6, 6), lambda g, f, y, x_: te.sum(
        x[g, rc, y + r, x_ + s] * w[g, f // 16, rc, r, s, f % 16], axis=[rc, r, s]), name="stacked")
    found = conv(out.op)
    assert found.stacked and found.weight_layout == "GOIHWo" and found.filters == 16
    assert found.reads_filter_blocks()
    assert conv2d(out.op) is None


def test_conv_non_matches():
    x = te.placeholder((1, 8, 4, 4), name="x")
    assert conv(x.op) is None  # a placeholder
    assert conv(te.compute(x.shape, lambda *i: x(*i) * 2.0).op) is None  # elementwise
    k = te.reduce_axis((0, 4), "k")
    assert conv(te.compute((1, 8, 4), lambda n, c, h: te.sum(x[n, c, h, k], axis=k)).op) is None  # no product
    a, b = te.placeholder((4, 8), name="a"), te.placeholder((8, 4), name="b")
    k = te.reduce_axis((0, 8), "k")
    assert conv(te.compute((4, 4), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k)).op) is None  # a GEMM
    out, _, _ = _conv()
    recurrent = te.ComputeOp("conv", "", {MEMBER: "cell"}, out.op.axis, out.op.reduce_axis, out.op.body)
    assert conv(recurrent) is not None and conv2d(recurrent) is None  # conv2d: outside recurrences only


def test_gemm_layouts():
    a, w = te.placeholder((4, 8), name="a"), te.placeholder((8, 16), name="w")
    k = te.reduce_axis((0, 8), "k")
    found = gemm(te.compute((4, 16), lambda i, j: te.sum(a[i, k] * w[k, j], axis=k)).op)
    assert (found.a_layout, found.b_layout, found.shape, found.batch) == ("MK", "KN", (4, 16, 8), 0)
    assert found.a.args[0].same_as(a) and found.b.args[0].same_as(w) and found.constant == "b"
    assert gemm(found.op, is_weight=lambda t: t.same_as(a)).constant == "a"
    wt = te.placeholder((16, 8), name="wt")
    h = te.compute((4, 8), lambda i, j: a[i, j] + 1.0, name="h")
    found = gemm(te.compute((4, 16), lambda i, j: te.sum(h[i, k] * wt[j, k], axis=k)).op)
    assert (found.a_layout, found.b_layout, found.constant) == ("MK", "NK", "b")
    packed = te.placeholder((2, 8, 8), name="packed")  # [N / P, K, P]
    found = gemm(te.compute((4, 16), lambda i, j: te.sum(h[i, k] * packed[j // 8, k, j % 8], axis=k)).op)
    assert found.b_layout == "packed" and not found.b_batched
    ta = te.placeholder((8, 4), name="ta")  # transA
    found = matmul(te.compute((4, 16), lambda i, j: te.sum(ta[k, i] * w[k, j], axis=k)).op)
    assert found.a_layout == "KM"


def test_batch_matmul_and_rows_over_one_weight():
    q, kt = te.placeholder((2, 4, 8), name="q"), te.placeholder((2, 8, 6), name="kt")
    k = te.reduce_axis((0, 8), "k")
    scores = te.compute((2, 4, 6), lambda b, i, j: te.sum(q[b, i, k] * kt[b, k, j], axis=k))
    found = batch_matmul(scores.op)
    assert found.batch == 1 and found.a_batched and found.b_batched and gemm(scores.op) is None
    w = te.placeholder((8, 6), name="w")
    rows = te.compute((2, 4, 6), lambda b, i, j: te.sum(q[b, i, k] * w[k, j], axis=k))
    assert gemm(rows.op) is not None and batch_matmul(rows.op) is None


def test_matmul_non_matches():
    a, b = te.placeholder((4, 8), name="a"), te.placeholder((8, 4), name="b")
    k = te.reduce_axis((0, 8), "k")
    assert matmul(te.compute((4, 4), lambda i, j: te.sum(a[i, k] * b[j % 8, j], axis=k)).op) is None
    assert matmul(te.compute((4,), lambda i: te.sum(a[i, k] * b[k, 0], axis=k)).op) is None  # a GEMV row
    assert matmul(te.compute((4, 4), lambda i, j: te.sum(a[i, k], axis=k)).op) is None
    out, _, _ = _conv()
    assert matmul(out.op) is None


def test_row_reduce():
    x = te.placeholder((4, 6, 10), name="x")
    r = te.reduce_axis((0, 10), "r")
    found = row_reduce(te.compute((4, 6), lambda i, j: te.max(x[i, j, r], axis=r)).op)
    assert found.kind == "max" and not found.keepdims and found.length == 10 and found.tensors[0].same_as(x)
    found = row_reduce(te.compute((4, 6, 1), lambda i, j, _: te.sum(te.exp(x[i, j, r]), axis=r)).op)
    assert found.kind == "sum" and found.keepdims
    r2 = te.reduce_axis((0, 6), "r2")
    assert row_reduce(te.compute((4, 10), lambda i, j: te.sum(x[i, r2, j], axis=r2)).op) is None  # not last
    assert row_reduce(te.compute((4,), lambda i: te.sum(x[i, 0, r], axis=r)).op) is None  # not the rows'
    assert row_reduce(te.compute((4, 6), lambda i, j: x[i, j, 0]).op) is None


def test_layout_ranks():
    x = te.placeholder((1, 8, 4, 4), name="x")
    y = te.compute(x.shape, lambda n, c, h, w: x[n, c, h, w] * 2.0)
    read = product_reduction(_conv()[0].op).loads[0]
    assert rank(read) == 4 and in_layout(read, "NCHW") and not in_layout(read, "NCHWc")
    assert is_map(y.op) and not is_map(x.op) and not is_map(y.op, "NCW")
    assert has_rank(x, "NCHW") and LAYOUT_RANKS["OIHWo"] == 5
    assert product_reduction(y.op) is None


@pytest.mark.parametrize("groups", [1, 2, 8])
def test_matches_the_frontend_numerically_described(groups):
    """The named facts agree with the weight the frontend's conv reads, for each group count."""
    out, x, w = _conv(channels=8, filters=16, groups=groups)
    found = conv2d(out.op)
    assert found.groups == groups and found.group_channels == 8 // groups
    assert np.prod(found.kernel) == 9
