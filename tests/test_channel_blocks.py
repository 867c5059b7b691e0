"""te_passes/channel_blocks.py: convolution networks carried in channel blocks from conv to conv."""

import numpy as np
from tvm import te

from models.common import GraphBuilder, conv_bn
from models.resnext import Config, _bottleneck
from souffle_py.frontend import import_onnx
from souffle_py.schedule.default import schedule_cpu
from te_passes.channel_blocks import block_conv_networks
from te_passes.check import assert_same_outputs
from te_passes.conv_layout import widen_weight_blocks
from souffle_py.ir.graph import isolate
from souffle_py.passes import transformed
from tests.onnx_cases import assert_matches_ort

BLOCK = 32
SIZE = 8


def _bottlenecks(cin: int = 32, planes: int = 32, blocks: int = 2, stride: int = 2):
    """ResNeXt bottlenecks (1x1, grouped 3x3 of 4 groups, 1x1, residual add), the first with a strided
    projection; every map has a multiple of 32 channels."""
    config = Config(cardinality=4, base_width=16)
    b = GraphBuilder("bottlenecks", seed=0, opset=17)
    x = b.input("x", [1, cin, SIZE, SIZE])
    y = conv_bn(b, x, "stem", cin, cin, 1)
    y = b.node("Relu", [y])
    for i in range(blocks):
        y = _bottleneck(b, y, f"block{i}", cin if i == 0 else planes * 4, planes, stride if i == 0 else 1, config)
    b.output(b.node("GlobalAveragePool", [y]), [1, planes * 4, 1, 1])
    return b.model(), {"x": np.random.default_rng(1).standard_normal((1, cin, SIZE, SIZE)).astype(np.float32)}


def _prepared(model):
    program, _ = transformed(import_onnx(model))
    return widen_weight_blocks(program, BLOCK)


def _blocked(program):
    return [op for op in program.stages if len(op.axis) == 5]


def test_maps_between_convs_are_stored_in_channel_blocks():
    model, feeds = _bottlenecks()
    program = _prepared(model)
    blocked = block_conv_networks(program, BLOCK)
    assert len(blocked.stages) == len(program.stages)  # stored in blocks, no layout copies
    # every map between the convolutions: convs, pads, activations, residual adds
    four_d = [op for op in blocked.stages if len(op.axis) == 4 and [int(d) for d in op.output(0).shape[2:]] != [1, 1]]
    assert four_d == [], [op.name for op in four_d]
    assert all(int(op.axis[-1].dom.extent) == BLOCK for op in _blocked(blocked))
    assert_same_outputs(program, blocked, feeds=feeds, rtol=1e-5, atol=1e-5)


def test_blocked_pointwise_conv_writes_whole_vectors():
    model, _ = _bottlenecks(blocks=1)
    blocked = block_conv_networks(_prepared(model), BLOCK)
    conv = next(op for op in blocked.stages if op.name.startswith("block0_conv3") and op.reduce_axis)
    text = schedule_cpu(te.create_prim_func([t for part in isolate(conv) for t in part])).script()
    write_back = text[:text.rindex('_local")')].rsplit("for ", 1)[-1]  # the write-back's innermost loop
    assert "T.vectorized(" in write_back  # a row of the register tile stored as vectors, not transposed


def test_an_elementwise_reader_outside_the_blocks_reads_through_them():
    """A Transpose reads the last conv's activation across channels: it cannot be stored in blocks, but it
    reads the blocked map through its blocks (the reorder in its own pass), so the network up to it keeps
    its blocks."""
    b = GraphBuilder("transposed", seed=0, opset=17)
    x = b.input("x", [1, BLOCK, SIZE, SIZE])
    y = b.node("Relu", [conv_bn(b, x, "a", BLOCK, BLOCK, 1)])
    y = b.node("Relu", [conv_bn(b, y, "b", BLOCK, BLOCK, 1)])
    y = b.node("Transpose", [y], perm=[0, 2, 3, 1])
    b.output(b.node("Relu", [y]), [1, SIZE, SIZE, BLOCK])
    program = _prepared(b.model())
    blocked = block_conv_networks(program, BLOCK)
    names = {op.name for op in _blocked(blocked)}
    assert any(n.startswith("a_") for n in names) and any(n.startswith("b_") for n in names)
    feeds = {"x": np.random.default_rng(2).standard_normal((1, BLOCK, SIZE, SIZE)).astype(np.float32)}
    assert_same_outputs(program, blocked, feeds=feeds, rtol=1e-5, atol=1e-5)


def test_a_reader_that_reduces_across_channels_keeps_its_input_nchw():
    """A mean over the channels would gather inside its reduction loop: the map it reads, and so its
    producers up to the conv, stay NCHW; the conv before them still reads and writes blocks."""
    b = GraphBuilder("channel_mean", seed=0, opset=17)
    x = b.input("x", [1, BLOCK, SIZE, SIZE])
    y = b.node("Relu", [conv_bn(b, x, "a", BLOCK, BLOCK, 1)])
    y = b.node("Relu", [conv_bn(b, y, "b", BLOCK, BLOCK, 1)])
    b.output(b.node("ReduceMean", [y], axes=[1], keepdims=1), [1, 1, SIZE, SIZE])
    program = _prepared(b.model())
    blocked = block_conv_networks(program, BLOCK)
    names = {op.name for op in _blocked(blocked)}
    assert any(n.startswith("a_") for n in names)
    assert not any(n.startswith("b_") for n in names)
    feeds = {"x": np.random.default_rng(2).standard_normal((1, BLOCK, SIZE, SIZE)).astype(np.float32)}
    assert_same_outputs(program, blocked, feeds=feeds, rtol=1e-5, atol=1e-5)


def test_ragged_channels_are_padded_to_the_block():
    """24 channels: stored in one padded block (channel_padding.py), values unchanged."""
    b = GraphBuilder("ragged", seed=0, opset=17)
    x = b.input("x", [1, 24, SIZE, SIZE])
    y = b.node("Relu", [conv_bn(b, x, "a", 24, 24, 1)])
    b.output(b.node("Relu", [conv_bn(b, y, "b", 24, 24, 3, 1)]), [1, 24, SIZE, SIZE])
    program = _prepared(b.model())
    blocked = block_conv_networks(program, BLOCK)
    five_d = _blocked(blocked)
    assert five_d and all(int(op.output(0).shape[1]) == 1 for op in five_d)
    feeds = {"x": np.random.default_rng(2).standard_normal((1, 24, SIZE, SIZE)).astype(np.float32)}
    assert_same_outputs(program, blocked, feeds=feeds, rtol=1e-5, atol=1e-5)


def test_bottlenecks_match_onnx_runtime():
    model, feeds = _bottlenecks()
    assert_matches_ort(model, feeds)


def _branches_into_pools(filters):
    """Two convs of `filters` channels, the second reading the first, concatenated into a 3x3 max pool and a
    global average pool (GoogLeNet's inception modules, whose concats the vertical pass folds into the pools
    that read them)."""
    b = GraphBuilder("branches", seed=0, opset=17)
    x = b.input("x", [1, BLOCK, SIZE, SIZE])
    y = b.node("Relu", [conv_bn(b, x, "stem", BLOCK, BLOCK, 1)])
    first = b.node("Relu", [conv_bn(b, y, "branch0", BLOCK, filters[0], 1)])
    second = b.node("Relu", [conv_bn(b, first, "branch1", filters[0], filters[1], 3)])  # not combined with it
    cat = b.node("Concat", [first, second], axis=1)
    pooled = b.node("MaxPool", [cat], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    b.output(b.node("GlobalAveragePool", [pooled]), [1, sum(filters), 1, 1])
    return b.model()


def test_pools_over_a_folded_concat_read_its_branches_in_blocks():
    """A pool reads the branches of a concat folded into it at an offset per branch (c - 64): at offsets the
    block divides it reduces one channel per lane as before, so the branches and the pool keep their blocks
    (GoogLeNet's max pools over four branches ran over NCHW maps at 4 GFLOP/s)."""
    program = _prepared(_branches_into_pools((64, 32)))
    blocked = block_conv_networks(program, BLOCK)
    four_d = [op.name for op in blocked.stages if len(op.axis) == 4 and [int(d) for d in op.output(0).shape[2:]] != [1, 1]]
    assert four_d == [] and any("MaxPool" in op.name for op in _blocked(blocked))
    feeds = {"x": np.random.default_rng(3).standard_normal((1, BLOCK, SIZE, SIZE)).astype(np.float32)}
    assert_same_outputs(program, blocked, feeds=feeds, rtol=1e-5, atol=1e-5)


def test_a_concat_offset_the_block_does_not_divide_keeps_the_pool_nchw():
    """At 40 + 40 channels (16-channel blocks) the second branch's lanes would straddle two blocks: the pool
    stays in NCHW."""
    program = _prepared(_branches_into_pools((40, 40)))
    blocked = block_conv_networks(program, BLOCK)
    assert not any("MaxPool" in op.name for op in _blocked(blocked))
    feeds = {"x": np.random.default_rng(3).standard_normal((1, BLOCK, SIZE, SIZE)).astype(np.float32)}
    assert_same_outputs(program, blocked, feeds=feeds, rtol=1e-5, atol=1e-5)


def test_a_concat_offset_only_half_the_block_divides_takes_blocks_of_half():
    """Branches of 48 + 16 channels concatenated into a max pool, in a network whose wide tail conv holds it to
    two-vector blocks: the second branch starts inside a block of 32 (48) but on a 16-channel boundary, so the
    branches, the concat folded into the pool and the pool take blocks of 16 instead of leaving the pool in
    NCHW (GoogLeNet's inception 4a, 192 + 208 + 48 + 64: its next max pool 0.09 -> 0.03 ms)."""
    b = GraphBuilder("half_blocks", seed=0, opset=17)
    x = b.input("x", [1, BLOCK, SIZE, SIZE])
    y = b.node("Relu", [conv_bn(b, x, "stem", BLOCK, BLOCK, 1)])
    first = b.node("Relu", [conv_bn(b, y, "branch0", BLOCK, 48, 1)])
    second = b.node("Relu", [conv_bn(b, y, "branch1", BLOCK, 16, 3)])
    pooled = b.node("MaxPool", [b.node("Concat", [first, second], axis=1)], kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    tail = b.node("Relu", [conv_bn(b, pooled, "tail", 64, 256, 3)])
    b.output(b.node("GlobalAveragePool", [tail]), [1, 256, 1, 1])
    model = b.model()
    program = _prepared(model)
    blocked = block_conv_networks(program, BLOCK)
    lanes = {op.name: int(op.output(0).shape[-1]) for op in _blocked(blocked)}
    pools = [n for n in lanes if "MaxPool" in n]
    assert pools and {lanes[n] for n in pools} == {16}, lanes
    assert {lanes[n] for n in lanes if n.startswith("tail_conv")} == {BLOCK}, lanes  # its pad reads the pool: 16
    feeds = {"x": np.random.default_rng(3).standard_normal((1, BLOCK, SIZE, SIZE)).astype(np.float32)}
    assert_same_outputs(program, blocked, feeds=feeds, rtol=1e-5, atol=1e-5)
    assert_matches_ort(model, feeds)


def test_a_dense_conv_over_a_channel_slice_pads_into_blocks():
    """ShuffleNet's branch: a 1x1 conv over the second half of a split (58 of 116 channels) is dense, its
    input channel independent of its filter, so its 58 output channels are padded into blocks like any dense
    conv's (it used to keep NCHW: only convs reading their whole input counted as dense)."""
    b = GraphBuilder("split_branch", seed=0, opset=17)
    x = b.input("x", [1, BLOCK, SIZE, SIZE])
    y = b.node("Relu", [conv_bn(b, x, "stem", BLOCK, 116, 1)])
    _, second = b.node("Split", [y, b.const("halves", np.array([58, 58], np.int64))], outputs=2, axis=1)
    z = b.node("Relu", [conv_bn(b, second, "branch", 58, 58, 1)])
    z = b.node("Relu", [conv_bn(b, z, "branch2", 58, 58, 3)])
    b.output(b.node("GlobalAveragePool", [z]), [1, 58, 1, 1])
    model = b.model()
    program = _prepared(model)
    blocked = block_conv_networks(program, BLOCK)
    assert any(op.name.startswith("branch_c") for op in _blocked(blocked)), [op.name for op in _blocked(blocked)]
    feeds = {"x": np.random.default_rng(5).standard_normal((1, BLOCK, SIZE, SIZE)).astype(np.float32)}
    assert_same_outputs(program, blocked, feeds=feeds, rtol=1e-5, atol=1e-5)
    assert_matches_ort(model, feeds)


def test_a_depthwise_conv_left_in_nchw_reads_no_blocks_it_would_gather():
    """EdgeNeXt's downsampling: a dense conv to 88 channels, then a 7x7 depthwise conv whose reader (a mean
    over channels) keeps it in NCHW. 88 channels have no whole vectors, so the depthwise conv vectorizes
    along its rows: its input (the pad) stays in NCHW rather than be read 32 floats apart (0.014 -> 0.16 ms)."""
    b = GraphBuilder("edge_down", seed=0, opset=17)
    x = b.input("x", [1, 48, SIZE, SIZE])
    y = conv_bn(b, x, "down", 48, 88, 1)
    z = conv_bn(b, y, "dw", 88, 88, 7, groups=88)
    mean = b.node("ReduceMean", [z], axes=[1], keepdims=1)
    b.output(b.node("Sub", [z, mean]), [1, 88, SIZE, SIZE])
    program = _prepared(b.model())
    blocked = block_conv_networks(program, BLOCK)
    depthwise = next(op for op in blocked.stages if op.name.startswith("dw_conv") and op.reduce_axis)
    maps = [t for t in depthwise.input_tensors if isinstance(t.op, te.ComputeOp)]
    assert maps and all(len(t.shape) == 4 for t in maps), maps
    feeds = {"x": np.random.default_rng(6).standard_normal((1, 48, SIZE, SIZE)).astype(np.float32)}
    assert_same_outputs(program, blocked, feeds=feeds, rtol=1e-5, atol=1e-5)


def test_each_network_component_chooses_its_block():
    """A 16-channel stem at 32 x 32 (its padding to 32 channels would double the convs' work) and a
    128-channel tail behind a strided dense conv: the dense conv reads its input one channel at a time, so
    the two sides choose their blocks apart, 16 for the stem and the strided conv's pad, two vectors (32)
    for the strided conv and the tail. Values unchanged, and the compiled model matches ONNX Runtime."""
    b = GraphBuilder("two_widths", seed=0, opset=17)
    x = b.input("x", [1, 3, 32, 32])
    stem = b.node("Relu", [conv_bn(b, x, "stem", 3, 16, 3)])
    stem = b.node("Relu", [conv_bn(b, stem, "stem2", 16, 16, 3)])
    y = b.node("Relu", [conv_bn(b, stem, "down", 16, 128, 3, stride=4)])
    z = b.node("Relu", [conv_bn(b, y, "tail", 128, 128, 3)])
    y = b.node("Add", [y, conv_bn(b, z, "tail2", 128, 128, 3)])
    b.output(b.node("GlobalAveragePool", [b.node("Relu", [y])]), [1, 128, 1, 1])
    model = b.model()
    program = _prepared(model)
    blocked = block_conv_networks(program, BLOCK)
    lanes = {op.name.rsplit("_c", 1)[0]: int(op.output(0).shape[-1]) for op in _blocked(blocked)}
    assert {lanes[n] for n in lanes if n.startswith("stem2")} == {16}, lanes
    assert lanes["down_pad"] == 16 and lanes["down_conv"] == BLOCK, lanes
    assert {lanes[n] for n in lanes if n.startswith("tail_conv")} == {BLOCK}, lanes  # its pad reads the pool: 16
    feeds = {"x": np.random.default_rng(4).standard_normal((1, 3, 32, 32)).astype(np.float32)}
    assert_same_outputs(program, blocked, feeds=feeds, rtol=1e-5, atol=1e-5)
    assert_matches_ort(model, feeds)


def test_a_map_scaled_by_a_computed_scalar_is_blocked_through_it():
    """A 0-d tensor read by an op over a map (dynamic quantization's scale, computed by a reduction) is one
    element for every lane: the pass goes on (it raised IndexError on a quantize_dynamic BERT)."""
    b = GraphBuilder("scalar_scale", seed=0, opset=17)
    x = b.input("x", [1, BLOCK, SIZE, SIZE])
    y = b.node("Relu", [conv_bn(b, x, "a", BLOCK, BLOCK, 1)])
    scale = b.node("ReduceMax", [x], keepdims=0)  # 0-d, of the input (a reduction over a conv's output
    # across its channels would keep that conv NCHW)
    y = b.node("Mul", [y, scale])
    b.output(b.node("Relu", [conv_bn(b, y, "b", BLOCK, BLOCK, 1)]), [1, BLOCK, SIZE, SIZE])
    program = _prepared(b.model())
    blocked = block_conv_networks(program, BLOCK)
    assert any(op.name.startswith("a_") for op in _blocked(blocked))
    feeds = {"x": np.random.default_rng(3).standard_normal((1, BLOCK, SIZE, SIZE)).astype(np.float32)}
    assert_same_outputs(program, blocked, feeds=feeds, rtol=1e-5, atol=1e-5)
    assert_matches_ort(b.model(), feeds)
