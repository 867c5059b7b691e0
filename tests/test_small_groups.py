"""te_passes/small_groups.py: grouped convolutions with small groups over block-diagonal weights."""

import numpy as np
import pytest

from models.common import GraphBuilder, conv_bn
from souffle_py.frontend import import_onnx
from souffle_py.passes import conv_weights_blocked
from te_passes.check import assert_same_outputs
from te_passes.small_groups import densify_small_groups
from tests.onnx_cases import assert_matches_ort

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


@pytest.mark.parametrize("stride", [1, 2])
def test_four_channel_groups_read_a_dense_block_diagonal_weight(stride):
    program = conv_weights_blocked(import_onnx(_grouped_model(32, 8, stride)))
    dense = densify_small_groups(program, 4)
    shapes = _weights(dense)
    assert [s for n, s in shapes.items() if n.endswith("_dense")] == [(2, 16, 3, 3, 16)]
    assert len(dense.stages) == len(program.stages)
    assert_same_outputs(program, dense, feeds=_feeds(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("channels,groups", [(32, 4), (32, 32), (32, 1)])
def test_larger_groups_depthwise_and_dense_convs_are_left_alone(channels, groups):
    """8-channel groups (break even), depthwise (1 channel per group) and a dense conv keep their weights."""
    program = conv_weights_blocked(import_onnx(_grouped_model(channels, groups)))
    assert densify_small_groups(program, 4) is program


@pytest.mark.parametrize("channels,groups,window", [(48, 2, 48), (48, 4, 24), (96, 4, 48)])
def test_groups_straddling_the_blocks_read_a_window_of_whole_groups(channels, groups, window):
    """24- and 12-channel groups under 16-channel blocks (Visformer): each block reads the whole groups it
    touches, W input channels, the window kept inside the map."""
    program = conv_weights_blocked(import_onnx(_grouped_model(channels, groups)))
    dense = densify_small_groups(program, 4)
    shapes = [s for n, s in _weights(dense).items() if n.endswith("_dense")]
    assert shapes == [(channels // 16, window, 3, 3, 16)]
    assert_same_outputs(program, dense, feeds=_feeds(), rtol=1e-5, atol=1e-5)


def test_straddling_groups_match_onnx_runtime():
    assert_matches_ort(_grouped_model(48, 2), _feeds())


def test_densified_groups_match_onnx_runtime():
    assert_matches_ort(_grouped_model(64, 16), _feeds())
