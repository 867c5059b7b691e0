"""Every default rule applies inside the merged kernels of real model shapes: a rule that fails is logged
at DEBUG and leaves its stage serial and scalar (TVM's loop_partition on an earlier block once made every
later GEMM of EdgeNeXt's kernels run at 1% of peak, silently). Compile-only; no timing."""

import logging

import numpy as np
import pytest

import souffle_py
from models import patterns
from models.common import GraphBuilder
from models.registry import build_model
from tests.onnx_cases import assert_matches_ort


class _Skips(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        message = record.getMessage()
        if "schedule skipped" in message:
            self.lines.append(message.splitlines()[0])


@pytest.fixture
def skips():
    handler, logger = _Skips(), logging.getLogger("souffle_py.schedule")
    level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    yield handler.lines
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.mark.parametrize("name", ["bert", "resnext", "efficientnet", "swin"])
def test_no_rule_fails_in_the_tiny_paper_models(name, skips):
    souffle_py.optimize(build_model(name, tiny=True), quiet=True)
    assert skips == []


@pytest.mark.parametrize("build", [lambda: patterns.mobilenet_v3_block(), lambda: patterns.dense_block(),
                                   lambda: patterns.grouped_block(), lambda: patterns.asymmetric(32, 17)],
                         ids=["mobilenet_v3_block", "dense_block", "grouped_block", "asymmetric"])
def test_no_rule_fails_in_the_corpus_patterns(build, skips):
    model, _ = build()
    souffle_py.optimize(model, quiet=True)
    assert skips == []


def _squeeze_excite_then_classifier():
    """MobileNetV3-small's tail: a squeeze-excite over 96 channels whose 72-channel ReLU runs whole vectors
    and a partitioned tail, then the classifier GEMV (1024 columns of a weight read transposed) in the same
    kernel. Before the partitions waited for every rule, the GEMV's rfactor failed after that partition."""
    b = GraphBuilder("se_head", seed=0, opset=17)
    x = b.input("x", [1, 96, 7, 7])
    s = b.node("Relu", [b.node("Conv", [b.node("GlobalAveragePool", [x]), b.weight("w1", [72, 96, 1, 1]),
                                        b.weight("b1", [72])])])
    s = b.node("HardSigmoid", [b.node("Conv", [s, b.weight("w2", [96, 72, 1, 1]), b.weight("b2", [96])])],
               alpha=1 / 6, beta=0.5)
    pooled = b.node("Flatten", [b.node("GlobalAveragePool", [b.node("Mul", [x, s])])])
    b.output(b.node("Gemm", [pooled, b.weight("wc", [1024, 96]), b.weight("bc", [1024])], transB=1), [1, 1024])
    return b.model()


def test_no_rule_fails_after_a_partitioned_block(skips):
    model = _squeeze_excite_then_classifier()
    souffle_py.optimize(model, quiet=True)
    assert skips == []
    rng = np.random.default_rng(0)
    assert_matches_ort(model, {"x": rng.standard_normal((1, 96, 7, 7)).astype(np.float32)})
