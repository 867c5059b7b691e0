"""te_passes/small_groups.py: grouped convolutions with small groups over block-diagonal weights."""

import numpy as np
import pytest

from models.common import GraphBuilder, conv_bn
from souffle_py.cpu_target import using
from souffle_py.frontend import import_onnx
from souffle_py.passes import conv_weights_blocked
from te_passes.check import assert_same_outputs
from te_passes.small_groups import densify_small_groups
from tests.onnx_cases import assert_matches_ort
from test_cpu_target import HASWELL, SPR

SIZE = 8


def _grouped_model(channels: int, groups: int, stride: int = 1):
    """1x1 conv + BN + ReLU, then a grouped 3x3 conv + BN: ResNeXt's bottleneck middle."""
    b = GraphBuilder("grouped", seed=0, opset=17)
    x = b.input("x", [1, 8, SIZE, SIZE])
    y = b.node("Relu", [conv_bn(b, x, "reduce", 8, channels, 1)])
    y = conv_bn(b, y, "grouped", channels, channels, 3, stride, groups=groups)
    b.output(y, [1, channels, (SIZE - 1) // stride + 1, (SIZE - 1) // stride + 1])
    return b.model()


def _feeds():
    return {"x": np.random.default_rng(1).standard_normal((1, 8, SIZE, SIZE)).astype(np.float32)}


def _weights(program):
    return {n: v.shape for n, v in program.params.items() if n.startswith("grouped")}


@pytest.mark.parametrize("target", [HASWELL, SPR])
@pytest.mark.parametrize("stride", [1, 2])
def test_four_channel_groups_read_a_dense_block_diagonal_weight(stride, target):
    """Each weight block of the target's vector (8 or 16 channels) reads the whole groups it holds."""
    with using(target) as cpu:
        program = conv_weights_blocked(import_onnx(_grouped_model(32, 8, stride)))
        dense = densify_small_groups(program, 4)
    shapes = _weights(dense)
    block = cpu.lanes
    assert [s for n, s in shapes.items() if n.endswith("_dense")] == [(32 // block, block, 3, 3, block)]
    assert len(dense.stages) == len(program.stages)
    assert_same_outputs(program, dense, feeds=_feeds(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("channels,groups", [(32, 4), (32, 32), (32, 1)])
def test_larger_groups_depthwise_and_dense_convs_are_left_alone(channels, groups):
    """8-channel groups (break even), depthwise (1 channel per group) and a dense conv keep their weights."""
    program = conv_weights_blocked(import_onnx(_grouped_model(channels, groups)))
    assert densify_small_groups(program, 4) is program


@pytest.mark.parametrize("target,channels", [(HASWELL, 12), (SPR, 4)])
def test_depthwise_convs_in_4_channel_weight_blocks_are_left_alone(target, channels):
    """One channel per group under 4-channel weight blocks (12 channels under AVX2's 8 and 4, MixNet's 60; 4
    under AVX-512's): depthwise convs have a channel-vectorized schedule of their own, and densified they did
    4x the multiply-adds and read their input lanes shifted within the channel blocks."""
    with using(target) as cpu:
        program = conv_weights_blocked(import_onnx(_grouped_model(channels, channels)))
        assert [s[-1] for s in _weights(program).values() if len(s) == 5] == [4]
        assert densify_small_groups(program, cpu.lanes // 4) is program  # as passes/cpu.py calls it


@pytest.mark.parametrize("target,channels,groups,window", [(SPR, 48, 2, 48), (SPR, 48, 4, 24), (SPR, 96, 4, 48),
                                                          (HASWELL, 48, 4, 24)])
def test_groups_straddling_the_blocks_read_a_window_of_whole_groups(target, channels, groups, window):
    """24- and 12-channel groups under 16-channel blocks (Visformer), 12-channel ones under AVX2's 8: each
    block reads the whole groups it touches, W input channels, the window kept inside the map."""
    with using(target) as cpu:
        program = conv_weights_blocked(import_onnx(_grouped_model(channels, groups)))
        dense = densify_small_groups(program, 4)
    shapes = [s for n, s in _weights(dense).items() if n.endswith("_dense")]
    block = cpu.lanes
    assert shapes == [(channels // block, window, 3, 3, block)]
    assert_same_outputs(program, dense, feeds=_feeds(), rtol=1e-5, atol=1e-5)


def test_straddling_groups_match_onnx_runtime():
    assert_matches_ort(_grouped_model(48, 2), _feeds())


def test_densified_groups_match_onnx_runtime():
    assert_matches_ort(_grouped_model(64, 16), _feeds())
