"""The token-input sentence transformer (models/sbert.py): int64 token inputs, Gather embeddings, a bool
attention mask, mean pooling and L2 normalization compile with every pass preset and match ONNX Runtime."""

from __future__ import annotations

import numpy as np
import pytest

import souffle_py
from models import sbert
from models.registry import build_model
from souffle_py.baselines import OnnxRuntimeModel

RTOL, ATOL = 1e-4, 1e-5


def _check(model, feeds, **options):
    ours = souffle_py.optimize(model, quiet=True, **options).run(feeds)
    reference = OnnxRuntimeModel(model, threads=1).run(feeds)
    for name, expected in reference.items():
        assert ours[name].shape == expected.shape and ours[name].dtype == expected.dtype
        np.testing.assert_allclose(ours[name], expected, rtol=RTOL, atol=ATOL, err_msg=name)


@pytest.mark.parametrize("options", [{"passes": "none"}, {"passes": "V1"}, {"passes": "all"}, {"merge": False}],
                         ids=["V0", "V1", "V2", "unfused"])
def test_tiny_matches_onnx_runtime(options):
    _check(build_model("sbert", tiny=True), sbert.example_feeds(sbert.TINY), **options)


def test_tiny_layernorm_op_spelling():
    _check(build_model("sbert", tiny=True, layernorm="op"), sbert.example_feeds(sbert.TINY))


def test_the_mask_matters():
    """Padding changes the embedding only through the mask: a different padded token changes nothing."""
    model = souffle_py.optimize(build_model("sbert", tiny=True), quiet=True)
    feeds = sbert.example_feeds(sbert.TINY)
    changed = dict(feeds, input_ids=feeds["input_ids"].copy())
    changed["input_ids"][0, -1] = (changed["input_ids"][0, -1] + 1) % sbert.TINY.vocab
    np.testing.assert_allclose(model.run(feeds)["sentence_embedding"], model.run(changed)["sentence_embedding"],
                               rtol=1e-5, atol=1e-6)
    unmasked = dict(feeds, attention_mask=np.ones_like(feeds["attention_mask"]))
    assert not np.allclose(model.run(feeds)["sentence_embedding"], model.run(unmasked)["sentence_embedding"])


def test_full_size_matches_onnx_runtime():
    _check(build_model("sbert"), sbert.example_feeds(sbert.PAPER))
