"""te_passes/depthwise_blocks.py: depthwise (and pooled) conv outputs and their elementwise readers in channel blocks."""

import numpy as np
import pytest
from tvm import te

from models.common import GraphBuilder
from models.efficientnet import _mbconv
from souffle_py.frontend import import_onnx
from souffle_py.schedule.blocks import vector_lanes
from souffle_py.schedule.default import schedule_cpu
from te_passes.check import assert_same_outputs
from te_passes.conv_layout import block_depthwise_inputs
from te_passes.depthwise_blocks import block_depthwise_outputs
from souffle_py.ir.graph import isolate
from souffle_py.passes import transformed
from tests.onnx_cases import assert_matches_ort

VECTOR = vector_lanes()  # the host's: what a test outside cpu_target.using compiles for

SIZE = 14


def _mbconv_model(channels: int = 8):
    """One EfficientNet MBConv block (expand x6, 5x5 depthwise, squeeze-excite, project, residual)."""
    b = GraphBuilder("mbconv", seed=0, opset=17)
    x = b.input("x", [1, channels, SIZE, SIZE])
    y = _mbconv(b, x, "block", channels, channels, expand=6, kernel=5, stride=1, se_ratio=0.25)
    b.output(y, [1, channels, SIZE, SIZE])
    return b.model()


def _feeds(channels: int = 8):
    return {"x": np.random.default_rng(1).standard_normal((1, channels, SIZE, SIZE)).astype(np.float32)}


def _prepared(model):
    program, _ = transformed(import_onnx(model))
    return block_depthwise_inputs(program, VECTOR)


def test_depthwise_chain_stores_channel_blocks():
    model = _mbconv_model()
    program = _prepared(model)
    blocked = block_depthwise_outputs(program, VECTOR)
    chain = [op for op in blocked.stages if op.name.endswith(f"_conv_c{VECTOR}") or op.name.endswith(f"_silu_c{VECTOR}")
             or op.name.endswith(f"_scale_c{VECTOR}")]
    shapes = {op.name.rsplit("_", 2)[-2]: [int(d) for d in op.output(0).shape] for op in chain}
    assert shapes == {n: [1, 48 // VECTOR, SIZE, SIZE, VECTOR] for n in ("conv", "silu", "scale")}
    assert len(blocked.stages) == len(program.stages)  # stored in blocks, no copies
    assert_same_outputs(program, blocked, feeds=_feeds(), rtol=1e-5, atol=1e-5)
    conv = [op for op in chain if op.reduce_axis][0]
    text = schedule_cpu(te.create_prim_func([t for part in isolate(conv) for t in part])).script()
    write_back = text[:text.rindex('_local")')].rsplit("for ", 1)[-1]  # the write-back's innermost loop
    assert f"T.vectorized({VECTOR})" in write_back  # whole vectors, no NCHW transposition


def test_ragged_channels_keep_nchw():
    """24 expanded channels (not a multiple of the vector): the depthwise conv stays NCHW."""
    if 24 % VECTOR == 0:
        pytest.skip("24 channels are whole vectors on this host")
    program = _prepared(_mbconv_model(channels=4))
    assert block_depthwise_outputs(program, VECTOR) is program


def test_blocked_chain_matches_onnx_runtime():
    assert_matches_ort(_mbconv_model(), _feeds())


def test_conv_read_only_by_a_global_pool_stores_channel_blocks():
    """EfficientNet's head: 1x1 conv -> BN + SiLU -> global average pool. The conv stores its weight's
    channel blocks and the pool (BN + SiLU composed in) reduces one channel per lane."""
    from models.common import conv_bn
    from souffle_py.schedule.conv import conv_max_lanes

    CONV_MAX_LANES = conv_max_lanes()
    from te_passes.conv_layout import widen_weight_blocks

    b = GraphBuilder("head", seed=0, opset=17)
    x = b.input("x", [1, 16, 7, 7])
    y = conv_bn(b, x, "head", 16, 2 * CONV_MAX_LANES, 1)
    y = b.node("Mul", [y, b.node("Sigmoid", [y])])
    b.output(b.node("GlobalAveragePool", [y]), [1, 2 * CONV_MAX_LANES, 1, 1])
    model = b.model()
    program, _ = transformed(import_onnx(model))
    program = widen_weight_blocks(program, CONV_MAX_LANES)
    blocked = block_depthwise_outputs(program, VECTOR)
    convs = [op for op in blocked.stages if len(op.axis) == 5]
    assert [[int(d) for d in op.output(0).shape] for op in convs] == [[1, 2, 7, 7, CONV_MAX_LANES]]
    feeds = {"x": np.random.default_rng(1).standard_normal((1, 16, 7, 7)).astype(np.float32)}
    assert_same_outputs(program, blocked, feeds=feeds, rtol=1e-5, atol=1e-5)
    pool = [op for op in blocked.stages if convs[0].output(0) in list(op.input_tensors)]
    text = schedule_cpu(te.create_prim_func([t for part in isolate(pool[0]) for t in part])).script()
    assert f"T.vectorized({VECTOR})" in text
    assert_matches_ort(model, feeds)
