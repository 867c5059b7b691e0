"""te_passes/pointwise_gemm.py: 1x1 convs over flat maps run as GEMMs; values kept, layout as intended."""

import numpy as np
import pytest
from tvm import te

from models.common import GraphBuilder, conv_bn
from models.efficientnet import _mbconv
from souffle_py.frontend import import_onnx
from souffle_py.schedule.default import VECTOR, schedule_cpu
from te_passes.check import assert_same_outputs
from te_passes.conv_layout import block_depthwise_inputs
from te_passes.graph import isolate
from te_passes.pipeline import PassPipeline
from te_passes.pointwise_gemm import pointwise_convs_as_gemms
from te_passes.squeeze_excite import fold_channel_scales
from tests.onnx_cases import assert_matches_ort


def _mbconv_model(size: int):
    """One EfficientNet MBConv block (expand, depthwise, squeeze-excite, project, residual)."""
    b = GraphBuilder("mbconv", seed=0, opset=17)
    x = b.input("x", [1, 8, size, size])
    y = _mbconv(b, x, "block", 8, 8, expand=6, kernel=3, stride=1, se_ratio=0.25)
    b.output(y, [1, 8, size, size])
    return b.model()


def _prepared(model):
    """The CPU backend's layouts up to this pass: SE folded, depthwise input in channel blocks."""
    program, _ = PassPipeline.from_spec("all").run(import_onnx(model))
    return block_depthwise_inputs(fold_channel_scales(program), VECTOR)


def _feeds(size):
    return {"x": np.random.default_rng(1).standard_normal((1, 8, size, size)).astype(np.float32)}


def test_project_conv_becomes_a_gemm_over_a_flat_map():
    size = 16
    program = _prepared(_mbconv_model(size))
    flat = pointwise_convs_as_gemms(program, VECTOR)
    gemms = [op for op in flat.stages if len(op.axis) == 3 and len(op.reduce_axis) == 1]
    assert len(gemms) == 1 and [int(d) for d in gemms[0].output(0).shape] == [1, 8, size * size]
    stored_flat = [op for op in flat.stages if op.name.endswith("_flat")]
    assert len(stored_flat) == 2  # the depthwise conv and the BN + SiLU after it
    assert all([int(d) for d in op.output(0).shape] == [1, 48, size * size] for op in stored_flat)
    assert len(flat.stages) == len(program.stages)
    assert_same_outputs(program, flat, feeds=_feeds(size), rtol=1e-5, atol=1e-5)
    text = schedule_cpu(te.create_prim_func([t for part in isolate(gemms[0]) for t in part])).script()
    assert "T.vectorized(" in text and "_local" in text  # a register-tiled GEMM, vectors along p


@pytest.mark.parametrize("size", [14, 7])
def test_maps_without_whole_vectors_keep_the_conv(size):
    """14 x 14 and 7 x 7 maps: H * W is not a multiple of the vector, the GEMM would run in scalars."""
    if (size * size) % VECTOR == 0:
        pytest.skip("a multiple of this host's vector")
    program = _prepared(_mbconv_model(size))
    assert pointwise_convs_as_gemms(program, VECTOR) is program


def test_conv_over_a_graph_input_stays():
    """A 1x1 conv reading a graph input (stored as the caller gives it): nothing to flatten."""
    b = GraphBuilder("pw", seed=0, opset=17)
    x = b.input("x", [1, 8, 16, 16])
    b.output(conv_bn(b, x, "pw", 8, 16, 1), [1, 16, 16, 16])
    program = _prepared(b.model())
    assert pointwise_convs_as_gemms(program, VECTOR) is program


def test_flat_block_matches_onnx_runtime():
    assert_matches_ort(_mbconv_model(16), _feeds(16))
