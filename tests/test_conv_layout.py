"""te_passes/conv_layout.py: depthwise convolutions read channel blocks; values kept, structure as intended."""

import numpy as np
import pytest
from tvm import te

from models.common import GraphBuilder, conv_bn
from souffle_py.cpu_target import using
from souffle_py.frontend import import_onnx
from souffle_py.ir.program import TEProgram
from souffle_py.passes import conv_weights_blocked
from souffle_py.schedule.blocks import vector_lanes
from souffle_py.schedule.default import schedule_cpu
from te_passes.check import assert_same_outputs
from te_passes.conv_layout import block_depthwise_inputs
from souffle_py.ir.graph import isolate
from tests.onnx_cases import assert_matches_ort
from test_cpu_target import HASWELL, SPR

VECTOR = vector_lanes()  # the host's: what a test outside cpu_target.using compiles for

BLOCK = 16


def _depthwise_model(channels: int, groups: int, stride: int, kernel: int = 3, size: int = 14):
    """conv 1x1 + BN + SiLU, then a (depthwise when groups == channels) conv + BN: EfficientNet's MBConv."""
    b = GraphBuilder("dw", seed=0, opset=17)
    x = b.input("x", [1, 8, size, size])
    y = conv_bn(b, x, "expand", 8, channels, 1)
    y = b.node("Mul", [y, b.node("Sigmoid", [y])])
    y = conv_bn(b, y, "dw", channels, channels, kernel, stride, groups=groups)
    b.output(y, [1, channels, (size - 1) // stride + 1, (size - 1) // stride + 1])
    return b.model()


def _feeds(size: int = 14):
    return {"x": np.random.default_rng(1).standard_normal((1, 8, size, size)).astype(np.float32)}


def _blocked_stages(program, block: int = BLOCK):
    return [op for op in program.stages if len(op.axis) == 5 and int(op.axis[-1].dom.extent) == block]


@pytest.mark.parametrize("stride,kernel", [(1, 3), (2, 3), (2, 5)])
def test_depthwise_input_is_stored_in_channel_blocks(stride, kernel):
    program = conv_weights_blocked(import_onnx(_depthwise_model(32, 32, stride, kernel)))
    blocked = block_depthwise_inputs(program, BLOCK)
    stages = _blocked_stages(blocked)
    assert len(stages) == 1  # the pad (with BN and SiLU composed) stores [1, 2, H, W, 16] directly
    assert [int(d) for d in stages[0].output(0).shape[:2]] == [1, 2]
    readers = [op for op in blocked.stages if stages[0].output(0) in list(op.input_tensors)]
    assert len(readers) == 1 and len(readers[0].reduce_axis) == 3  # the depthwise conv reads it
    assert len(blocked.stages) == len(program.stages) - 1  # no extra copy; SiLU's Mul composed into the pad
    assert_same_outputs(program, blocked, feeds=_feeds(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("channels,groups", [(32, 8), (24, 24), (32, 1)])
def test_grouped_dense_and_ragged_convs_keep_nchw(channels, groups):
    program = conv_weights_blocked(import_onnx(_depthwise_model(channels, groups, 1)))
    assert block_depthwise_inputs(program, BLOCK) is program


def test_shared_input_gets_a_blocked_copy():
    """An input the conv does not own (a graph input, no padding) is copied into blocks, not rewritten."""
    x = te.placeholder((1, 32, 8, 8), name="x")
    w = te.placeholder((2, 1, 1, 1, BLOCK), name="w")
    rc, r0, r1 = (te.reduce_axis((0, 1), name=n) for n in ("rc", "r0", "r1"))
    y = te.compute((1, 32, 8, 8), lambda n, f, i, j: te.sum(
        x[n, f + rc, i + r0, j + r1] * w[f // BLOCK, rc, r0, r1, f % BLOCK], axis=[rc, r0, r1]), name="conv")
    value = np.random.default_rng(0).standard_normal((2, 1, 1, 1, BLOCK)).astype(np.float32)
    program = TEProgram(inputs={"x": x}, params={"w": value}, param_tensors={"w": w}, outputs={"y": y})
    blocked = block_depthwise_inputs(program, BLOCK)
    assert len(_blocked_stages(blocked)) == 1 and len(blocked.stages) == 2
    assert_same_outputs(program, blocked)


def test_blocked_depthwise_and_pad_are_vectorized_over_channels():
    blocked = block_depthwise_inputs(conv_weights_blocked(import_onnx(_depthwise_model(32, 32, 2))), VECTOR)
    pad = _blocked_stages(blocked)[0] if VECTOR == BLOCK else None
    conv = [op for op in blocked.stages if len(op.reduce_axis) == 3][-1]
    func = schedule_cpu(te.create_prim_func([t for part in isolate(conv) for t in part]))
    text = func.script()
    assert f"T.vectorized({VECTOR})" in text and "_local" in text  # channel lanes, register accumulators
    if pad is not None:
        pad_func = schedule_cpu(te.create_prim_func([t for part in isolate(pad) for t in part]))
        assert f"T.vectorized({VECTOR})" in pad_func.script()


@pytest.mark.parametrize("stride,kernel", [(1, 3), (2, 5)])
def test_compiled_depthwise_matches_onnx_runtime(stride, kernel):
    assert_matches_ort(_depthwise_model(32, 32, stride, kernel), _feeds())


def test_dense_conv_weights_are_widened_to_the_register_tile():
    """Compiled for AVX-512, whose 224 accumulator lanes take 7 columns x 32 channels over this 8-channel
    reduction (AVX2's 56 prefer 7 x 8 to 3 x 16); the values on the host."""
    from souffle_py.schedule.conv import conv_max_lanes
    from te_passes.conv_layout import widen_weight_blocks

    with using(SPR):
        CONV_MAX_LANES = conv_max_lanes()
        program = conv_weights_blocked(import_onnx(_depthwise_model(2 * CONV_MAX_LANES, 2 * CONV_MAX_LANES, 1)))
        widened = widen_weight_blocks(program, CONV_MAX_LANES)
        shapes = {n: v.shape for n, v in widened.params.items() if v.ndim == 5}
        expand = [s for n, s in shapes.items() if n.startswith("expand")]
        dw = [s for n, s in shapes.items() if n.startswith("dw")]
        assert expand == [(2, 8, 1, 1, CONV_MAX_LANES)]  # the dense 1x1 conv: two wide blocks
        assert dw and dw[0][-1] < CONV_MAX_LANES  # depthwise keeps its blocks
        conv = [op for op in widened.stages if any("_x" in t.op.name for t in op.input_tensors)][0]
        text = schedule_cpu(te.create_prim_func([t for part in isolate(conv) for t in part])).script()
        assert f"T.vectorized({CONV_MAX_LANES})" in text  # one tile spans the wide block
    assert_same_outputs(program, widened, feeds=_feeds(), rtol=1e-5, atol=1e-5)


def test_widened_weights_match_onnx_runtime_end_to_end():
    assert_matches_ort(_depthwise_model(64, 64, 1), _feeds())


def _inception_model(size: int = 14):
    """GoogLeNet's inception block, small: three 1x1 branch convs of one input, 3x3 convs on two of them.
    horizontal.py stacks the 1x1 convs, then the two 3x3 convs' pads: each 3x3 conv reads its slice of the
    stacked pad (channels 0..63 and 64..79 of 80)."""
    b = GraphBuilder("inception", seed=0, opset=17)
    x = b.input("x", [1, 8, size, size])

    def conv(y, name, cin, cout, kernel):
        return b.node("Relu", [conv_bn(b, y, name, cin, cout, kernel, fold_bn=True)])
    left = conv(x, "left", 8, 32, 1)
    mid = conv(conv(x, "mid", 8, 64, 1), "mid3x3", 64, 64, 3)
    right = conv(conv(x, "right", 8, 16, 1), "right3x3", 16, 32, 3)
    b.output(b.node("Concat", [left, mid, right], axis=1), [1, 128, size, size])
    return b.model()


def test_a_conv_reading_a_channel_slice_of_stacked_convs_has_its_weight_widened():
    """GoogLeNet's 3x3 branch convs read their share of the stacked 1x1 convs' output; their weights kept
    16-channel blocks, so their 32-channel tiles gathered the weight and fell back to 16 lanes (the model
    7% slower)."""
    from souffle_py.schedule.conv import conv_max_lanes

    CONV_MAX_LANES = conv_max_lanes()
    from te_passes.conv_layout import widen_weight_blocks
    from souffle_py.passes import transformed
    program = transformed(import_onnx(_inception_model()))[0]
    sliced = [op for op in program.stages if op.name.startswith("mid3x3") and op.reduce_axis]
    assert sliced and any(len(t.shape) == 4 and int(t.shape[1]) == 80 for t in sliced[0].input_tensors)
    widened = widen_weight_blocks(program, CONV_MAX_LANES)
    shapes = {n.split("_")[0]: v.shape for n, v in widened.params.items() if n.endswith(f"_x{CONV_MAX_LANES}")}
    assert shapes["mid3x3"] == (64 // CONV_MAX_LANES, 64, 3, 3, CONV_MAX_LANES)
    assert shapes["right3x3"] == (32 // CONV_MAX_LANES, 16, 3, 3, CONV_MAX_LANES)
    assert_same_outputs(program, widened, feeds=_feeds(), rtol=1e-5, atol=1e-5)


def test_a_conv_reading_a_channel_slice_matches_onnx_runtime_end_to_end():
    assert_matches_ort(_inception_model(), _feeds())


def test_conv_feeding_a_blocked_pad_stores_channel_blocks():
    """expand conv -> (BN + SiLU composed into the pad by the vertical pass) -> depthwise: the 1x1 conv
    stores [1, F / b, H, W, b] (b its weight's block), so its register tile is written back as whole
    vectors and the pad reads contiguous channels; values unchanged, and ONNX Runtime agrees. Compiled for
    AVX-512, whose tile spans the 32-channel block (AVX2's takes 8 of its 16 lanes); run on the host."""
    from souffle_py.schedule.conv import conv_max_lanes
    from te_passes.conv_layout import widen_weight_blocks
    from souffle_py.passes import transformed

    with using(SPR):
        CONV_MAX_LANES = conv_max_lanes()
        model = _depthwise_model(2 * CONV_MAX_LANES, 2 * CONV_MAX_LANES, 2)
        program, _ = transformed(import_onnx(model))
        program = widen_weight_blocks(program, CONV_MAX_LANES)
        blocked = block_depthwise_inputs(program, BLOCK)
        convs = [op for op in blocked.stages if len(op.axis) == 5 and len(op.reduce_axis) == 3]
        assert len(convs) == 1 and int(convs[0].axis[-1].dom.extent) == CONV_MAX_LANES
        pads = [op for op in blocked.stages if convs[0].output(0) in list(op.input_tensors)]
        assert len(pads) == 1 and not pads[0].reduce_axis and int(pads[0].axis[-1].dom.extent) == BLOCK
        text = schedule_cpu(te.create_prim_func([t for part in isolate(convs[0]) for t in part])).script()
        write_back = text[:text.rindex('_local")')].rsplit("for ", 1)[-1]  # the write-back's innermost loop
        assert f"T.vectorized({CONV_MAX_LANES})" in write_back  # whole vectors, no NCHW transposition
    assert_same_outputs(program, blocked, feeds=_feeds(), rtol=1e-5, atol=1e-5)
    assert_matches_ort(model, _feeds())


@pytest.mark.parametrize("target", [HASWELL, SPR])
def test_bn_silu_kept_out_of_a_wide_pad_moves_into_the_blocked_pad(target):
    """A 5x5 depthwise conv on a 14 x 14 map: the vertical pass keeps BN + SiLU out of the pad (18 x 18
    points for 14 x 14 values is over its recompute budget), but blocking composes it into the pad anyway:
    no separate (scalar, 14-wide rows) pass over the map, and the expand conv stores channel blocks (of the
    target's vector)."""
    from souffle_py.passes import transformed

    model = _depthwise_model(32, 32, 1, kernel=5, size=14)
    with using(target) as cpu:
        program, _ = transformed(import_onnx(model))
        elementwise = [op for op in program.stages if not op.reduce_axis and len(op.axis) == 4
                       and not any(len(r.reduce_axis) for r in program.consumers().get(op, []))]
        assert elementwise  # BN + SiLU stayed a TE of its own, read by the pad
        blocked = block_depthwise_inputs(program, cpu.lanes)
    assert len(blocked.stages) == len(program.stages) - 1
    pads = [op for op in _blocked_stages(blocked, cpu.lanes) if not op.reduce_axis]
    convs = [op for op in _blocked_stages(blocked, cpu.lanes) if len(op.reduce_axis) == 3]
    assert len(pads) == 1 and len(convs) == 1  # the expand conv stores channel blocks too
    assert [t.op.name for t in pads[0].input_tensors if len(t.shape) > 1] == [convs[0].name]
    assert_same_outputs(program, blocked, feeds=_feeds(14), rtol=1e-5, atol=1e-5)
    assert_matches_ort(model, _feeds(14))


def _ragged_filters_model(filters: int):
    """conv 1x1 of `filters` outputs + BN + ReLU, then a conv back to 8 channels: the first conv's F is
    one no vector divides (ShuffleNet's 58, 116)."""
    b = GraphBuilder("ragged", seed=0, opset=17)
    x = b.input("x", [1, 8, 14, 14])
    y = b.node("Relu", [conv_bn(b, x, "first", 8, filters, 1)])
    b.output(conv_bn(b, y, "second", filters, 8, 3), [1, 8, 14, 14])
    return b.model()


@pytest.mark.parametrize("target,filters,padded", [(SPR, 58, 64), (SPR, 40, 48), (SPR, 116, 128),
                                                   (HASWELL, 58, 64), (HASWELL, 44, 48), (HASWELL, 116, 120)])
def test_convs_of_ragged_filter_counts_compute_padded_filters(target, filters, padded):
    """Padded to 32 where that pads no more than to the target's vector (16 lanes, 8 with AVX2: 116 -> 120)."""
    from te_passes.conv_layout import pad_filters
    with using(target) as cpu:
        program = conv_weights_blocked(import_onnx(_ragged_filters_model(filters)))
        new = pad_filters(program, 32, cpu.lanes)
    shapes = [[int(d) for d in op.output(0).shape] for op in new.stages if op.name.startswith("first")]
    assert [1, padded, 14, 14] in shapes  # the padded conv; its readers read the first F channels
    assert all(op.output(0).shape[1] == 8 for op in new.stages if op.name.startswith("second_conv"))  # <= a vector
    assert_same_outputs(program, new, feeds=_feeds(), rtol=1e-5, atol=1e-5)


def test_padded_filters_match_onnx_runtime_end_to_end():
    assert_matches_ort(_ragged_filters_model(58), _feeds())


def _res2net_model(width: int = 20, size: int = 14):
    """Res2Net's first block of a stage, small: a 1x1 conv's output split four ways, three 3x3 convs of
    `width` filters on the first three splits (horizontal.py stacks them over a branch axis), concat."""
    b = GraphBuilder("res2net", seed=0, opset=17)
    x = b.input("x", [1, 8, size, size])
    y = b.node("Relu", [conv_bn(b, x, "conv1", 8, 4 * width, 1, fold_bn=True)])
    splits = b.node("Split", [y, b.const("sizes", np.array([width] * 4, np.int64))], outputs=4, axis=1)
    branches = [b.node("Relu", [conv_bn(b, part, f"convs{i}", width, width, 3, fold_bn=True)])
                for i, part in enumerate(splits[:3])]
    b.output(b.node("Concat", [*branches, splits[3]], axis=1), [1, 4 * width, size, size])
    return b.model()


@pytest.mark.parametrize("target,padded", [(SPR, 32), (HASWELL, 24)])
def test_stacked_convs_of_ragged_filter_counts_pad_each_branch(target, padded):
    """Res2Net's stacked 3x3 convs of 26 or 52 filters ran 4-lane tiles (54 GFLOP/s): each branch's filters
    are padded to whole vectors (20 to two of AVX-512's, three of AVX2's)."""
    from te_passes.conv_layout import pad_filters
    from souffle_py.passes import transformed
    with using(target) as cpu:
        program = transformed(import_onnx(_res2net_model()))[0]
        stacked = [op for op in program.stages if op.name.startswith("convs") and op.reduce_axis]
        assert [[int(d) for d in op.output(0).shape] for op in stacked] == [[3, 20, 14, 14]]
        new = pad_filters(program, 32, cpu.lanes)
    shapes = [[int(d) for d in op.output(0).shape] for op in new.stages if op.name.startswith("convs") and op.reduce_axis]
    assert shapes == [[3, padded, 14, 14]]
    assert_same_outputs(program, new, feeds=_feeds(), rtol=1e-5, atol=1e-5)


def test_stacked_padded_convs_match_onnx_runtime_end_to_end():
    assert_matches_ort(_res2net_model(), _feeds())


@pytest.mark.parametrize("groups", [88, 22])
def test_grouped_and_depthwise_convs_keep_their_filter_count(groups):
    """A depthwise (EdgeNeXt's 88 channels) or grouped conv reads its input at channels that follow the
    filter: padded filters would read past the input's channels (an out-of-bounds read that also broke the
    kernel's schedule), so only dense convs are padded."""
    from te_passes.conv_layout import pad_filters
    b = GraphBuilder("grouped", seed=0, opset=17)
    x = b.input("x", [1, 88, 14, 14])
    y = b.node("Conv", [x, b.weight("w", [88, 88 // groups, 3, 3])], group=groups, pads=[1, 1, 1, 1],
               kernel_shape=[3, 3])
    b.output(b.node("Relu", [y]), [1, 88, 14, 14])
    program = conv_weights_blocked(import_onnx(b.model()))
    new = pad_filters(program, 32, VECTOR)
    assert all(int(op.output(0).shape[1]) == 88 for op in new.stages if len(op.output(0).shape) == 4)
    feeds = {"x": np.random.default_rng(0).standard_normal((1, 88, 14, 14)).astype(np.float32)}
    assert_matches_ort(b.model(), feeds)


def _relu6_depthwise_model(channels: int, size: int):
    """MobileNetV2's stride-2 step: expand conv 1x1 (BN folded) + ReLU6, then a 3x3 depthwise conv, stride 2."""
    b = GraphBuilder("dw6", seed=0, opset=17)
    x = b.input("x", [1, 8, size, size])
    y = conv_bn(b, x, "expand", 8, channels, 1, fold_bn=True)
    y = b.node("Clip", [y, b.const("lo", np.float32(0.0)), b.const("hi", np.float32(6.0))])
    y = conv_bn(b, y, "dw", channels, channels, 3, 2, groups=channels, fold_bn=True)
    b.output(y, [1, channels, size // 2, size // 2])
    return b.model()


def test_a_depthwise_conv_with_its_pad_and_clip_composed_reads_channel_blocks():
    """The vertical pass composes a cheap pad + bias + clip into a stride-2 depthwise conv (each input read
    2.25 times), which then read no tensor in channel blocks and ran as a scalar reduction where
    channel_blocks.py left it in NCHW. The operand becomes a TE of its own over the padded input, stored
    in channel blocks like any pad; the compiled model matches ONNX Runtime."""
    from te_passes.conv_layout import separate_depthwise_operands
    from souffle_py.passes import transformed

    model = _relu6_depthwise_model(32, 28)
    program, _ = transformed(import_onnx(model))
    conv = next(op for op in program.stages if len(op.reduce_axis) == 3 and int(op.reduce_axis[0].dom.extent) == 1)
    assert len(conv.input_tensors) == 3  # precondition: the expand conv's output, the bias and the weight
    separated = separate_depthwise_operands(program)
    assert len(separated.stages) == len(program.stages) + 1
    assert_same_outputs(program, separated, feeds=_feeds(28), rtol=1e-5, atol=1e-5)
    assert block_depthwise_inputs(program, BLOCK) is program  # composed, it is no depthwise conv to block
    blocked = block_depthwise_inputs(separated, BLOCK)
    conv = next(op for op in blocked.stages if len(op.reduce_axis) == 3 and int(op.reduce_axis[0].dom.extent) == 1)
    assert any(len(t.shape) == 5 and int(t.shape[-1]) == BLOCK and not t.op.reduce_axis
               for t in conv.input_tensors)  # the padded, clipped input in blocks of 16 channels
    assert_same_outputs(program, blocked, feeds=_feeds(28), rtol=1e-5, atol=1e-5)
    assert_matches_ort(model, _feeds(28))


def _channels_last_norm_model(channels: int = 64, filters: int = 128, size: int = 7):
    """CoAtNet's LayerNorm2d before a 1x1 conv: the norm over channels runs channels-last between two
    transposes, which the vertical pass folds, so the conv reads a [1, H, W, C] map."""
    b = GraphBuilder("ln_conv", seed=0, opset=17)
    x = b.input("x", [1, channels, size, size])
    y = b.node("Transpose", [x], perm=[0, 2, 3, 1])
    y = b.node("LayerNormalization", [y, b.weight("scale", [channels]), b.weight("bias", [channels])], axis=-1)
    y = b.node("Transpose", [y], perm=[0, 3, 1, 2])
    y = b.node("Conv", [y, b.weight("w", [filters, channels, 1, 1]), b.weight("b", [filters])])
    b.output(b.node("Relu", [y]), [1, filters, size, size])
    return b.model()


def _channels_last_feeds(channels: int = 64, size: int = 7):
    return {"x": np.random.default_rng(2).standard_normal((1, channels, size, size)).astype(np.float32)}


def test_a_conv_reading_a_channels_last_map_has_its_weight_widened():
    """Its weight kept 16-channel blocks while its output took 32-channel ones, so its 16-lane tile had two
    output-channel axes, neither chunked nor streamed, and swept its 4 MB weight once per row of the map:
    CoAtNet's 512 -> 2048 conv at 7 x 7, 1.2 ms in the model against ONNX Runtime's 0.53."""
    from souffle_py.schedule.conv import conv_max_lanes

    CONV_MAX_LANES = conv_max_lanes()
    from te_passes.conv_layout import widen_weight_blocks
    from souffle_py.passes import transformed
    program = transformed(import_onnx(_channels_last_norm_model()))[0]
    conv = [op for op in program.stages if len(op.reduce_axis) == 3]
    assert len(conv) == 1 and any([int(d) for d in t.shape] == [1, 7, 7, 64] for t in conv[0].input_tensors)
    widened = widen_weight_blocks(program, CONV_MAX_LANES)
    assert [v.shape for n, v in widened.params.items() if n.endswith(f"_x{CONV_MAX_LANES}")] == \
        [(128 // CONV_MAX_LANES, 64, 1, 1, CONV_MAX_LANES)]
    assert_same_outputs(program, widened, feeds=_channels_last_feeds(), rtol=1e-5, atol=1e-5)


def test_a_conv_reading_a_channels_last_map_matches_onnx_runtime_end_to_end():
    assert_matches_ort(_channels_last_norm_model(), _channels_last_feeds())
