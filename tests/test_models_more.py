"""The ResNeXt, EfficientNet, Swin and MMoE builders: valid, runnable, deterministic ONNX at their TINY sizes."""

from dataclasses import replace

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from models import efficientnet, mmoe, resnext, swin

MODULES = [resnext, efficientnet, swin, mmoe]

# The ops the compiler supports; the builders must stay within them.
ALLOWED_OPS = {
    "Conv", "BatchNormalization", "Relu", "MaxPool", "AveragePool", "GlobalAveragePool", "Sigmoid", "Mul",
    "Add", "Sub", "Div", "Pow", "Sqrt", "Erf", "Tanh", "Softmax", "ReduceMean", "ReduceSum", "MatMul", "Gemm",
    "Reshape", "Transpose", "Unsqueeze", "Squeeze", "Flatten", "Concat", "Slice", "Split", "Gather",
    "LayerNormalization", "Clip", "Exp",
}

# The op kinds of each PAPER model: TINY must exercise every one of them.
PAPER_OPS = {
    resnext: {"Conv", "BatchNormalization", "Relu", "MaxPool", "Add", "GlobalAveragePool", "Flatten", "Gemm"},
    efficientnet: {"Conv", "BatchNormalization", "Sigmoid", "Mul", "Add", "GlobalAveragePool", "Flatten", "Gemm"},
    swin: {"Conv", "Transpose", "LayerNormalization", "Slice", "Concat", "Reshape", "MatMul", "Add", "Split",
           "Mul", "Gather", "Softmax", "Erf", "ReduceMean"},
    mmoe: {"MatMul", "Add", "Relu", "Unsqueeze", "Concat", "Softmax", "Mul", "ReduceSum", "Sigmoid"},
}


def _ids(modules):
    return [m.__name__.rsplit(".", 1)[-1] for m in modules]


def _run(model: onnx.ModelProto, seed: int = 0) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    shape = session.get_inputs()[0].shape
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return session.run(["output"], {"input": x})[0]


def _expected_shape(module, config):
    classes = config.tasks if module is mmoe else config.num_classes
    return (config.batch, classes)


@pytest.mark.parametrize("module", MODULES, ids=_ids(MODULES))
@pytest.mark.parametrize("batch", [1, 2])
def test_tiny_builds_and_runs(module, batch):
    config = replace(module.TINY, batch=batch)
    model = module.build(config)
    onnx.checker.check_model(model, full_check=True)
    assert [i.name for i in model.graph.input] == ["input"]
    assert [o.name for o in model.graph.output] == ["output"]
    y = _run(model)
    assert y.shape == _expected_shape(module, config)
    assert np.isfinite(y).all()
    assert 1e-3 < np.abs(y).max() < 1e2, "weights should keep activations O(1)"


@pytest.mark.parametrize("module", MODULES, ids=_ids(MODULES))
def test_tiny_uses_allowed_ops_and_covers_paper_ops(module):
    ops = {n.op_type for n in module.build(module.TINY).graph.node}
    assert ops <= ALLOWED_OPS
    assert ops == PAPER_OPS[module]


@pytest.mark.parametrize("module", MODULES, ids=_ids(MODULES))
def test_build_is_deterministic(module):
    first = module.build(module.TINY, seed=3).SerializeToString()
    assert module.build(module.TINY, seed=3).SerializeToString() == first
    assert module.build(module.TINY, seed=4).SerializeToString() != first


def test_resnext_fold_bn_matches_batchnorm():
    unfolded = resnext.build(resnext.TINY)
    folded = resnext.build(replace(resnext.TINY, fold_bn=True))
    assert "BatchNormalization" not in {n.op_type for n in folded.graph.node}
    np.testing.assert_allclose(_run(folded), _run(unfolded), rtol=1e-4, atol=1e-5)


def test_swin_shifted_blocks_are_masked():
    """Every odd block of a stage larger than its window rolls and masks; a window-sized stage does neither."""
    config = replace(swin.TINY, image_size=56, window_size=7)  # 14x14 then 7x7 tokens
    names = {n.name for n in swin.build(config).graph.node}
    assert "stage0/block1/attn/add_mask" in names and "stage0/block1/roll/h_concat" in names
    assert not any(n.startswith(("stage0/block0/roll", "stage1/block1/roll", "stage1/block1/attn/add_mask"))
                   for n in names)


def test_swin_rejects_windows_that_do_not_tile():
    with pytest.raises(ValueError, match="windows"):
        swin.build(replace(swin.TINY, window_size=5))
