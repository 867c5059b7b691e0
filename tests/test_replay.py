"""Process replay (souffle_py/replay.py): recording a model twice gives identical TIR, and a changed rule
shows as the kernels it changed, with their diffs."""

from __future__ import annotations

from models.registry import build_model
from souffle_py.replay import diff_records, format_diffs, record_model


def test_the_same_code_records_the_same_kernels(tmp_path):
    model = build_model("mmoe", tiny=True)
    assert record_model(model, tmp_path / "a" / "mmoe") >= 1
    record_model(model, tmp_path / "b" / "mmoe")
    assert diff_records(tmp_path / "a", tmp_path / "b") == []
    assert format_diffs([]) == "no kernel changed"


def test_a_changed_rule_shows_the_kernels_it_changed(tmp_path, monkeypatch):
    from souffle_py.schedule.rules import gemm_panel

    model = build_model("bert", tiny=True)
    record_model(model, tmp_path / "before" / "bert")
    monkeypatch.setattr(gemm_panel, "GEMM_EPILOGUE", not gemm_panel.GEMM_EPILOGUE)  # a rule's switch
    record_model(model, tmp_path / "after" / "bert")
    diffs = diff_records(tmp_path / "before", tmp_path / "after")
    assert [d.model for d in diffs] == ["bert"] and diffs[0].changed
    assert diff_records(tmp_path / "before", tmp_path / "after", structure_only=True)  # the loops moved too
    report = format_diffs(diffs)
    assert "## bert:" in report and "kernels changed" in report and "+++ after/" in report


def test_a_changed_value_leaves_the_structure(tmp_path, monkeypatch):
    """The fast-math clamps' operand order (which keeps NaN) changes the values computed, not the loops:
    the structure diff is empty."""
    import functools

    from souffle_py.codegen import fast_math

    model = build_model("bert", tiny=True)
    record_model(model, tmp_path / "before" / "bert")
    monkeypatch.setattr(fast_math, "_nan_keeping_clamps", lambda expr: expr)  # topi's order
    monkeypatch.setattr(fast_math, "_template", functools.cache(fast_math._template.__wrapped__))
    record_model(model, tmp_path / "after" / "bert")
    assert diff_records(tmp_path / "before", tmp_path / "after")
    assert diff_records(tmp_path / "before", tmp_path / "after", structure_only=True) == []
