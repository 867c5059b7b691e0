"""te_passes/unit_rows.py: 1-D convolution networks lifted to 2-D maps over one row, then channel-blocked
by the 2-D layout passes, values unchanged."""

import numpy as np
import pytest

from models.common import GraphBuilder
from souffle_py.backends.cpu import CpuBackend
from souffle_py.frontend import import_onnx
from te_passes.check import assert_same_outputs
from souffle_py.passes import prepared, transformed
from te_passes.unit_rows import lift_1d_convs
from tests.onnx_cases import assert_matches_ort

LENGTH = 40


def _conv1d(b, x, name, cin, cout, kernel, stride=1, dilation=1, groups=1, bias=True, pad=None):
    weight = b.weight(f"{name}/w", [cout, cin // groups, kernel])
    inputs = [x, weight] + ([b.weight(f"{name}/b", [cout], scale=0.1)] if bias else [])
    pad = (kernel - 1) * dilation // 2 if pad is None else pad
    return b.node("Conv", inputs, name=name, kernel_shape=[kernel], strides=[stride], dilations=[dilation],
                  pads=[pad, pad], group=groups)


def _audio_front_end(channels=48):
    """Whisper's front end: two GELU'd 1-D convs (the second strided), handed to a transformer as
    [N, W, C] by a transpose."""
    b = GraphBuilder("audio", seed=0, opset=20)
    x = b.input("x", [1, 20, LENGTH])
    y = b.node("Gelu", [_conv1d(b, x, "conv1", 20, channels, 3)])
    y = b.node("Gelu", [_conv1d(b, y, "conv2", channels, channels, 3, stride=2)])
    b.output(b.node("Transpose", [y], perm=[0, 2, 1]), [1, LENGTH // 2, channels])
    return b.model(), {"x": np.random.default_rng(1).standard_normal((1, 20, LENGTH)).astype(np.float32)}


def _temporal_block(channels=58):
    """A temporal CNN block over an odd channel count: dilated conv, batch norm, ReLU, a depthwise conv, a
    residual add, ending in the model output."""
    b = GraphBuilder("temporal", seed=0, opset=17)
    x = b.input("x", [1, channels, LENGTH])
    y = _conv1d(b, x, "dilated", channels, channels, 3, dilation=2, bias=False)
    stats = [b.const(f"bn_{p}", v.astype(np.float32)) for p, v in (
        ("gamma", 1 + 0.1 * np.arange(channels)), ("beta", 0.01 * np.arange(channels)),
        ("mean", 0.02 * np.arange(channels)), ("var", 1 + 0.05 * np.arange(channels)))]
    y = b.node("Relu", [b.node("BatchNormalization", [y, *stats], epsilon=1e-5)])
    y = _conv1d(b, y, "depthwise", channels, channels, 5, groups=channels)
    b.output(b.node("Add", [y, x]), [1, channels, LENGTH])
    return b.model(), {"x": np.random.default_rng(2).standard_normal((1, channels, LENGTH)).astype(np.float32)}


def _feature_encoder(channels=32):
    """wav2vec2's feature encoder, shortened: a wide strided conv straight over the waveform (no pad: it
    reads the model input, through a unit-row copy), then strided convs, each GELU'd."""
    b = GraphBuilder("waveform", seed=0, opset=20)
    x = b.input("x", [1, 1, 10 * LENGTH])
    y = b.node("Gelu", [_conv1d(b, x, "conv0", 1, channels, 10, stride=5, bias=False, pad=0)])
    y = b.node("Gelu", [_conv1d(b, y, "conv1", channels, channels, 3, stride=2, bias=False)])
    b.output(b.node("Gelu", [_conv1d(b, y, "conv2", channels, channels, 2, stride=2, bias=False)]), [1, channels, 20])
    return b.model(), {"x": np.random.default_rng(3).standard_normal((1, 1, 10 * LENGTH)).astype(np.float32)}


def _program(model):
    program, _ = transformed(import_onnx(model))
    return program


def _conv_ranks(program):
    return sorted(len(op.axis) for op in program.stages if op.name.startswith(("conv", "dilated", "depthwise"))
                  and op.reduce_axis)


@pytest.mark.parametrize("case", [_audio_front_end, _temporal_block, _feature_encoder])
def test_1d_convs_and_their_channel_wise_neighbours_become_unit_row_maps(case):
    model, feeds = case()
    program = _program(model)
    lifted = lift_1d_convs(program)
    assert _conv_ranks(program) and set(_conv_ranks(program)) == {3}
    assert set(_conv_ranks(lifted)) == {4}
    # lifted in place: no copies, but a unit-row copy of a model input a conv reads without a pad
    assert len(lifted.stages) == len(program.stages) + (case is _feature_encoder)
    for name, t in program.outputs.items():
        assert [int(d) for d in lifted.outputs[name].shape] == [int(d) for d in t.shape]
    assert_same_outputs(program, lifted, feeds=feeds, rtol=1e-5, atol=1e-5)


def test_a_transpose_reading_across_channels_stays_3d():
    model, _ = _audio_front_end()
    lifted = lift_1d_convs(_program(model))
    transpose = next(op for op in lifted.stages if op.name.startswith("Transpose"))
    assert len(transpose.axis) == 3
    pads = [op for op in lifted.stages if op.name.endswith("_pad")]  # GELUs composed in (vertical.py)
    assert pads and all(len(op.axis) == 4 for op in pads)


@pytest.mark.parametrize("case", [_audio_front_end, _temporal_block, _feature_encoder])
def test_lifted_networks_are_channel_blocked_and_match_onnx_runtime(case):
    model, feeds = case()
    lowered = prepared(_program(model), CpuBackend.for_target("llvm"), "-vertical,-horizontal", merge=False)
    convs = [op for op in lowered.stages if op.reduce_axis and op.name.startswith(("conv", "dilated"))]
    assert convs and all(len(op.axis) == 5 for op in convs), [(op.name, len(op.axis)) for op in convs]
    assert_matches_ort(model, feeds, rtol=1e-4, atol=1e-5)


def test_a_program_without_1d_convs_is_returned_unchanged():
    b = GraphBuilder("plain", seed=0, opset=17)
    x = b.input("x", [1, 8, LENGTH])
    b.output(b.node("Relu", [x]), [1, 8, LENGTH])
    program = _program(b.model())
    assert lift_1d_convs(program) is program


def test_a_bf16_gemm_whose_packed_weight_has_a_conv_weights_rank_is_not_lifted():
    """A bf16 GEMM's weight, packed [N / P, K / 2, P, 2], has as many axes as a 1-D conv's blocked weight
    [F / B, C, k, B]; lifted, tiny SBERT's GEMMs left the bf16 rule and its layouts crashed."""
    from models.registry import build_model
    from te_passes.precision import reduce_precision
    program = reduce_precision(_program(build_model("sbert", tiny=True)), "bf16")
    lifted = lift_1d_convs(program)
    assert lifted is program
