"""One failure policy for rules and passes (souffle_py/failures.py): a rule or pass that raises leaves its
stage to the generic schedule (or the program unchanged) with a warning naming the rule, the stage and the
exception, and the model still matches ONNX Runtime; under SOUFFLE_STRICT=1 it is a RuleFailedError.
Refusals (TVM's ScheduleError, RuleDoesNotApply) are a rule not applying, never a failure."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import souffle_py
from models.common import IR_VERSION
from models.registry import build_model
from onnx_cases import assert_matches_ort
from souffle_py import failures
from souffle_py.failures import RuleDoesNotApply, RuleFailedError, not_applied, rule_failed
from souffle_py.frontend import import_onnx
from souffle_py.passes import transformed


@pytest.fixture
def lenient(monkeypatch):
    monkeypatch.setenv(failures.STRICT_ENV, "0")


def test_strict_mode_raises_naming_rule_stage_and_exception(monkeypatch):
    monkeypatch.setenv(failures.STRICT_ENV, "1")
    with pytest.raises(RuleFailedError, match=r"row chain failed on s3: AttributeError: 'Cast' object"):
        rule_failed("row chain", "s3", AttributeError("'Cast' object has no attribute 'args'"))


def test_lenient_mode_warns(lenient, caplog):
    with caplog.at_level(logging.WARNING, logger="souffle_py.rules"):
        rule_failed("row chain", "s3", KeyError("x"), "the stage rules")
    assert "row chain failed on s3 (KeyError: 'x'); the stage rules instead" in caplog.text


def test_refusals_are_not_failures(monkeypatch, caplog):
    from tvm.s_tir import ScheduleError

    monkeypatch.setenv(failures.STRICT_ENV, "1")
    with caplog.at_level(logging.DEBUG, logger="souffle_py.rules"):
        not_applied("rule", "s0", ScheduleError("refused"))
        not_applied("rule", "s0", RuleDoesNotApply("no tile"))
    assert "does not apply" in caplog.text
    with pytest.raises(RuleFailedError):
        not_applied("rule", "s0", IndexError("bug"))


def _big_attention() -> "onnx.ModelProto":  # noqa: F821
    """One attention head group large enough (6 x 512 x 512 probabilities, 6 MB) for the softmax-GEMM rule."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["q", "kt"], ["qk"]), helper.make_node("Softmax", ["qk"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["o"])]
    graph = helper.make_graph(
        nodes, "attention", [helper.make_tensor_value_info("q", TensorProto.FLOAT, [6, 512, 16])],
        [helper.make_tensor_value_info("o", TensorProto.FLOAT, [6, 512, 16])],
        [numpy_helper.from_array(rng.standard_normal((6, 16, 512)).astype(np.float32), "kt"),
         numpy_helper.from_array(rng.standard_normal((6, 512, 16)).astype(np.float32), "v")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=IR_VERSION)


def test_a_failing_schedule_rule_leaves_its_stage_to_the_other_rules(lenient, monkeypatch, caplog):
    from souffle_py.schedule.rules import softmax_gemm as softmax_gemms

    def broken(*args):
        raise AttributeError("'Cast' object has no attribute 'args'")

    monkeypatch.setattr(softmax_gemms, "_softmax_operand", broken)
    feeds = {"q": np.random.default_rng(1).standard_normal((6, 512, 16)).astype(np.float32)}
    with caplog.at_level(logging.WARNING, logger="souffle_py.rules"):
        assert_matches_ort(_big_attention(), feeds)
    assert "softmax GEMM failed on" in caplog.text and "AttributeError" in caplog.text
    monkeypatch.setenv(failures.STRICT_ENV, "1")
    with pytest.raises(RuleFailedError, match="softmax GEMM failed on"):
        souffle_py.optimize(_big_attention(), quiet=True)


def test_a_failing_kernel_schedule_leaves_the_kernel_unscheduled(lenient, monkeypatch, caplog):
    from souffle_py.schedule import default

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in a rule")

    monkeypatch.setattr(default, "apply_rules", broken)
    model = build_model("mmoe", tiny=True)
    with caplog.at_level(logging.WARNING, logger="souffle_py.rules"):
        compiled = souffle_py.optimize(model, quiet=True)
    assert "the CPU schedule failed on the kernel of" in caplog.text
    feeds = compiled.random_feeds()
    monkeypatch.undo()
    expected = souffle_py.optimize(model, quiet=True).run(feeds)
    for name, value in compiled.run(feeds).items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-5, atol=1e-6)


def test_a_failing_pass_leaves_the_program_unchanged(lenient, monkeypatch, caplog):
    import te_passes.vertical

    def broken(program, analysis=None):
        raise ValueError("a bug in a pass")

    monkeypatch.setattr(te_passes.vertical, "vertical", broken)
    model = build_model("mmoe", tiny=True)
    with caplog.at_level(logging.WARNING, logger="souffle_py.rules"):
        compiled = souffle_py.optimize(model, quiet=True)
    assert "the vertical pass failed on the program (ValueError: a bug in a pass)" in caplog.text
    program = import_onnx(model)
    result, records = transformed(program, "vertical")
    assert result is program and "skipped" in records[0].summary
    feeds = compiled.random_feeds()
    expected = souffle_py.optimize(model, quiet=True, passes="none").run(feeds)
    for name, value in compiled.run(feeds).items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-4, atol=1e-5)
    monkeypatch.setenv(failures.STRICT_ENV, "1")
    with pytest.raises(RuleFailedError, match="the vertical pass failed"):
        souffle_py.optimize(model, quiet=True)
