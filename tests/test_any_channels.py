"""Convolutions at channel counts no rule was written for (issue 25): power-of-two conv vectors, channel
blocks padded up to the vector (te_passes/channel_padding.py), the network's block chosen by padded work.
Every model is checked against ONNX Runtime; tiny maps, the real channel counts."""

import numpy as np
import pytest
from tvm import te

from models.patterns import asymmetric, conv_relu, dense_block, grouped_block, inverted_residuals, mobilenet_v3_block
from souffle_py.backends.cpu import CpuBackend
from souffle_py.cpu_target import using
from souffle_py.frontend import import_onnx
from souffle_py.schedule.blocks import vector_lanes
from souffle_py.schedule.conv import conv_lanes
from souffle_py.schedule.default import schedule_cpu
from te_passes.channel_blocks import block_conv_networks, network_block
from te_passes.check import assert_same_outputs
from souffle_py.ir.graph import isolate
from souffle_py.passes import prepared, transformed
from tests.onnx_cases import assert_matches_ort
from test_cpu_target import HASWELL, SPR

VECTOR = vector_lanes()  # the host's: what a test outside cpu_target.using compiles for


def _prepared(model):
    program, _ = transformed(import_onnx(model))
    return program, prepared(program, CpuBackend.for_target("llvm"), "-vertical,-horizontal", merge=False)


@pytest.mark.parametrize("channels", [104, 116, 58, 72, 120, 184])
@pytest.mark.parametrize("kernel", [1, 3])
def test_convs_at_any_channel_count_match_onnx_runtime(channels, kernel):
    assert_matches_ort(*conv_relu(channels, kernel=kernel, size=7))


def test_grouped_conv_of_width_104_with_8_channels_per_group():
    assert_matches_ort(*conv_relu(104, kernel=3, groups=13, size=9))
    assert_matches_ort(*grouped_block(104, 8, size=9))


@pytest.mark.parametrize("cin, expand, cout", [(40, 120, 40), (24, 72, 40)])
def test_mobilenet_v3_block_with_hard_swish_and_squeeze_excite(cin, expand, cout):
    assert_matches_ort(*mobilenet_v3_block(cin, expand, cout, size=10, squeeze=32))


def test_inverted_residuals_with_24_channel_projections_are_carried_in_blocks():
    """MobileNetV2's blocks: expand, depthwise and the 24-channel project convs all store padded channel
    blocks (no flat map, no NCHW map between convolutions), and match ONNX Runtime."""
    model, feeds = inverted_residuals(size=16)
    program, prepared = _prepared(model)
    convs = [op for op in prepared.stages if op.reduce_axis and len(op.axis) > 2]
    assert len(convs) == 6 and all(len(op.axis) == 5 for op in convs), [op.name for op in convs]
    assert not [op.name for op in prepared.stages if len(op.axis) == 3]  # no [N, C, H * W] map
    assert_same_outputs(program, prepared, feeds=feeds, rtol=1e-5, atol=1e-5)
    assert_matches_ort(model, feeds)


def test_a_masked_tile_keeps_its_predicate_when_a_reader_outside_the_blocks_is_fused_into_it():
    """58 padded channels, a 1 x 5 depthwise conv over 40 columns in masked tiles of 7, its bias add the model
    output (NCHW, c < 58): TVM's reverse_compute_inline gave the tile's write-back the reader's predicate in
    place of its own, and the last tile stored columns 40 and 41 into the next channel's first row."""
    from models.common import GraphBuilder
    b = GraphBuilder("masked_write_back", seed=0, opset=17)
    x = b.input("x", [1, 58, 4, 40])
    y = b.node("Relu", [b.node("Conv", [x, b.weight("w", [58, 58, 1, 1])], kernel_shape=[1, 1])])
    y = b.node("Conv", [y, b.weight("dw", [58, 1, 1, 5]), b.weight("bias", [58], 0.1)], kernel_shape=[1, 5],
               pads=[0, 2, 0, 2], group=58)
    b.output(y, [1, 58, 4, 40])
    assert_matches_ort(b.model(), {"x": np.random.default_rng(3).standard_normal((1, 58, 4, 40)).astype(np.float32)})


def test_a_classifier_over_a_flattened_map_matches_onnx_runtime():
    """AlexNet's head: a 6 x 6 map flattened into a Gemm, read as X[0, k // 36, k % 36 // 6, k % 6] in
    vector lanes (blocks.lane_access on the flattened buffer)."""
    from models.common import GraphBuilder
    b = GraphBuilder("flattened_classifier", seed=0, opset=17)
    x = b.input("x", [1, 16, 6, 6])
    y = b.node("Relu", [b.node("Conv", [x, b.weight("w", [32, 16, 3, 3])], kernel_shape=[3, 3], pads=[1, 1, 1, 1])])
    y = b.node("Flatten", [y], axis=1)
    b.output(b.node("Gemm", [y, b.weight("fc", [40, 32 * 36]), b.weight("fc_b", [40], 0.1)], transB=1), [1, 40])
    assert_matches_ort(b.model(), {"x": np.random.default_rng(4).standard_normal((1, 16, 6, 6)).astype(np.float32)})


def test_dense_block_with_concats():
    assert_matches_ort(*dense_block(cin=48, growth=24, layers=3, size=9))


@pytest.mark.parametrize("channels, size", [(64, 35), (72, 17)])
def test_asymmetric_1x7_and_7x1_convs_over_odd_maps(channels, size):
    assert_matches_ort(*asymmetric(channels, size))


@pytest.mark.parametrize("target,width,group_width", [(SPR, 104, 8), (HASWELL, 52, 4)])
def test_padded_channel_blocks_keep_real_outputs_and_zero_the_padding(target, width, group_width):
    """RegNet's 104 channels under AVX-512's 16 lanes; 52 under AVX2's 8 (104 are 13 whole AVX2 vectors)."""
    model, feeds = grouped_block(width, group_width, size=9)
    with using(target) as cpu:
        program, _ = transformed(import_onnx(model))
        blocked = block_conv_networks(program, 2 * cpu.lanes)
        block = network_block(program, 2 * cpu.lanes)
    five_d = [op for op in blocked.stages if len(op.axis) == 5]
    assert five_d, "nothing stored in blocks"
    assert block == cpu.lanes  # 104 channels: 2 x 16 pads 23%, 16 pads 8% (52: 2 x 8, 8)
    assert all(int(op.output(0).shape[1]) == -(-width // block) for op in five_d)
    padded = [v for name, v in blocked.params.items() if name.endswith(f"_p{block}") and v.ndim == 5]
    assert padded and all(not np.any(np.moveaxis(v, -1, 1).reshape(-1, *v.shape[1:-1])[width:]) for v in padded)
    assert_same_outputs(program, blocked, feeds=feeds, rtol=1e-5, atol=1e-5)


def test_networks_of_multiples_of_two_vectors_keep_two_vector_blocks():
    model, _ = dense_block(cin=2 * 2 * VECTOR, growth=2 * VECTOR, layers=2, size=6)
    program, _ = transformed(import_onnx(model))
    assert network_block(program, 2 * VECTOR) == 2 * VECTOR


@pytest.mark.parametrize("channels", [104, 116, 58])
def test_conv_vectors_are_powers_of_two(channels):
    """A 1x1 conv over 28 columns and 104 channels once took a 28-lane (or 26-lane) vector, which LLVM
    builds element by element; every vector a conv tile takes is now a power of two."""
    model, _ = conv_relu(channels, size=28)
    program, _ = transformed(import_onnx(model))
    conv = next(op for op in program.stages if op.reduce_axis)
    text = schedule_cpu(te.create_prim_func([t for part in isolate(conv) for t in part])).script()
    widths = [int(part.split(")")[0]) for part in text.split("T.vectorized(")[1:]]
    assert widths and all(w in conv_lanes() for w in widths), widths
