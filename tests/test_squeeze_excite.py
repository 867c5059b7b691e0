"""te_passes/squeeze_excite.py: the SE gate scales the project conv's weight, not the feature map."""

import numpy as np
import pytest

from models.common import GraphBuilder
from models.efficientnet import _mbconv
from souffle_py.frontend import import_onnx
from te_passes.check import assert_same_outputs
from souffle_py.passes import transformed
from te_passes.squeeze_excite import fold_channel_scales
from tests.onnx_cases import assert_matches_ort


def _mbconv_model(size: int = 16, batch: int = 1, cout: int = 8):
    """One EfficientNet MBConv block (expand, depthwise, squeeze-excite, project) on an 8-channel map."""
    b = GraphBuilder("mbconv", seed=0, opset=17)
    x = b.input("x", [batch, 8, size, size])
    y = _mbconv(b, x, "block", 8, cout, expand=6, kernel=3, stride=1, se_ratio=0.25)
    b.output(y, [batch, cout, size, size])
    return b.model()


def _program(model):
    program, _ = transformed(import_onnx(model))
    return program


def _feeds(model):
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    return {"x": np.random.default_rng(1).standard_normal(shape).astype(np.float32)}


def _scales(program):
    """Elementwise TEs over a whole 48-channel map that read a [1, 48, 1, 1] gate."""
    return [op for op in program.stages if not op.reduce_axis and len(op.axis) == 4
            and int(op.axis[2].dom.extent) > 1
            and any([int(d) for d in t.shape] == [1, 48, 1, 1] for t in op.input_tensors)]


def test_scale_is_folded_into_the_project_weight():
    model = _mbconv_model()
    program = _program(model)
    folded = fold_channel_scales(program)
    assert len(_scales(program)) == 1 and not _scales(folded)  # the map pass is gone
    scaled = [op for op in folded.stages if op.name.endswith("_weight_scaled")]
    assert len(scaled) == 1 and len(scaled[0].axis) == 5  # one small TE of the weight's shape
    project = [op for op in folded.stages if scaled[0].output(0) in list(op.input_tensors)]
    assert len(project) == 1 and len(project[0].reduce_axis) == 3  # read by the 1x1 conv
    assert len(folded.stages) == len(program.stages)
    assert_same_outputs(program, folded, feeds=_feeds(model), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("size,batch", [(2, 1), (16, 2)])
def test_large_weights_and_batches_keep_the_scale(size, batch):
    """A weight larger than the map (2 x 2 maps), or a gate per image of a batch: nothing is folded."""
    program = _program(_mbconv_model(size=size, batch=batch))
    assert fold_channel_scales(program) is program


def test_folded_block_matches_onnx_runtime():
    model = _mbconv_model()
    assert_matches_ort(model, _feeds(model))
