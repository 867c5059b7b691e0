"""The tiny ResNeXt, EfficientNet, Swin and MMoE compile and match ONNX Runtime.

Tolerance: float32, rtol 1e-4 with atol 1e-5 for elements near zero; the outputs are O(1) by construction
(tests/test_models_more.py), so this is about 1e-4 relative to the output's scale.
"""

import numpy as np
import pytest

import souffle_py
from models.registry import build_model
from souffle_py.baselines import OnnxRuntimeModel

RTOL, ATOL = 1e-4, 1e-5

CASES = [("resnext", {}), ("resnext", {"fold_bn": True}), ("efficientnet", {}), ("swin", {}), ("mmoe", {})]


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("name,overrides", CASES, ids=[n + "".join(f"-{k}" for k in o) for n, o in CASES])
def test_tiny_model_matches_onnxruntime(name, overrides, batch):
    model = build_model(name, tiny=True, batch=batch, **overrides)
    compiled = souffle_py.optimize(model)
    feeds = compiled.random_feeds(seed=1)
    ours = compiled.run(feeds)["output"]
    reference = OnnxRuntimeModel(model, threads=2).run(feeds)["output"]
    assert ours.shape == reference.shape and np.isfinite(ours).all()
    np.testing.assert_allclose(ours, reference, rtol=RTOL, atol=ATOL)
