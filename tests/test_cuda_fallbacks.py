"""Every fallback of the grid-kernel scheduler is named (backends/cuda/__init__.py, report.py), without a
GPU: a grid kernel that does not lower runs its TEs as separate kernels whose cut reasons say why, a
warning names the kernel and the error, strict mode (SOUFFLE_STRICT=1) makes it an error, and the figures
of describe(), `souffle compile` and the corpus bench count it."""

import logging

import pytest

import souffle_py
from models.registry import build_model
from souffle_py.backends.cuda import report
from souffle_py.backends.cuda.report import grid_figures
from souffle_py.failures import STRICT_ENV, RuleFailedError


def _failing_lowering(monkeypatch, message="lowering refused"):
    """TVM's lowering of every grid kernel fails with ValueError(message)."""
    import souffle_py.backends.cuda as cuda

    compile_error = cuda._compile_error
    monkeypatch.setattr(cuda, "_compile_error", lambda name, func, target: ValueError(message) if name == "grid"
                        else compile_error(name, func, target))


def test_a_grid_kernel_that_does_not_lower_is_named_in_every_kernels_reason(monkeypatch, caplog):
    monkeypatch.delenv(STRICT_ENV, raising=False)
    _failing_lowering(monkeypatch)
    with caplog.at_level(logging.WARNING):
        model = souffle_py.optimize(build_model("mmoe", tiny=True), target="h100")
    calls = model.plan.calls
    assert len(calls) > 1 and not any(l.cooperative or l.grid for c in calls for l in c.launches)
    failed = f"{report.FAILED}: ValueError: lowering refused"
    assert calls[0].reason == f"program start; {failed}"
    assert all(c.reason.startswith(failed) and f"part {i + 1} of {len(calls)}" in c.reason
               for i, c in enumerate(calls) if i)
    assert f"grid schedule failed on kernel grid_{calls[0].stages[0]} (ValueError: lowering refused); its " \
           f"{len(calls)} TEs as {len(calls)} separate kernels instead" in caplog.text
    figures = grid_figures(model.plan)
    assert (figures.grid_kernels, figures.grid_tes, len(figures.fallbacks)) == (0, 0, len(calls))
    assert f"{len(calls)} fallbacks" in model.describe()


def test_in_strict_mode_a_grid_schedule_failure_is_an_error(monkeypatch):
    monkeypatch.setenv(STRICT_ENV, "1")
    _failing_lowering(monkeypatch)
    with pytest.raises(RuleFailedError, match="grid schedule failed on kernel grid_.*ValueError: lowering refused"):
        souffle_py.optimize(build_model("mmoe", tiny=True), target="h100")


def test_a_kernel_whose_gemm_stage_schedules_fail_keeps_grid_tiles_and_says_so(monkeypatch):
    """The first candidate (GEMM stages on their own schedules) fails to schedule: the kernel stays one
    grid kernel, its GEMM stages on grid.py's tile, and its reason names the failure."""
    import souffle_py.backends.cuda.schedule as schedule

    monkeypatch.delenv(STRICT_ENV, raising=False)
    marked = schedule.schedule_marked

    def refuse_stages(func, stages=None):
        if stages:
            raise RuntimeError("stage schedules refused")
        return marked(func, stages)

    monkeypatch.setattr(schedule, "schedule_marked", refuse_stages)
    proto = build_model("bert", tiny=True, layers=1, hidden=256, ffn=1024, seq=128, heads=4)
    model = souffle_py.optimize(proto, target="h100")
    (call,) = model.plan.calls
    assert call.launches[0].grid and call.launches[0].stage_schedules == ()
    assert call.reason == f"program start; {report.TILE} after: RuntimeError: stage schedules refused"
    assert grid_figures(model.plan).fallbacks == ((call.name, call.reason),)
    monkeypatch.setenv(STRICT_ENV, "1")
    with pytest.raises(RuleFailedError, match="stage schedules refused"):
        souffle_py.optimize(build_model("bert", tiny=True, layers=1, hidden=256, ffn=1024, seq=128, heads=8),
                            target="h100")


def _tiled_and_grid():
    """A grouped conv too large for a grid kernel (a tiled kernel of its own) between two grid kernels."""
    from conv_graphs import Graph

    g = Graph(64, 56)
    return g.model(g.op("Sigmoid", g.conv(g.op("Relu", g.conv(g.op("Relu", g.conv("x", 64)), 128, groups=2)), 64)))


def test_every_kernel_says_why_it_starts_where_it_does():
    for options in ({}, {"grid_sync": False}):
        model = souffle_py.optimize(_tiled_and_grid(), target="h100", **options)
        assert len(model.plan.calls) > 2
        assert all(call.reason for call in model.plan.calls), [c.name for c in model.plan.calls if not c.reason]
        assert grid_figures(model.plan).fallbacks == ()


def test_the_figures_count_launches_grid_kernels_syncs_and_the_share_of_tes():
    model = souffle_py.optimize(_tiled_and_grid(), target="h100")
    figures = grid_figures(model.plan)
    grid = [c for c in model.plan.calls if c.name.startswith("grid_")]
    assert figures.launches == model.num_kernels and figures.grid_syncs == model.grid_syncs
    assert figures.grid_kernels == len(grid) == 2 and figures.grid_tes == sum(len(c.stages) for c in grid)
    assert 0 < figures.share < 1 and figures.tes == sum(len(c.stages) for c in model.plan.calls)
    assert figures.line() in model.describe()


def test_souffle_compile_prints_the_figures_and_every_fallback(monkeypatch, tmp_path, capsys):
    import onnx

    from souffle_py import cli

    monkeypatch.delenv(STRICT_ENV, raising=False)
    _failing_lowering(monkeypatch)
    onnx.save(build_model("mmoe", tiny=True), tmp_path / "mmoe.onnx")
    assert cli.main(["compile", str(tmp_path / "mmoe.onnx"), "--target", "h100"]) == 0
    out = capsys.readouterr().out
    summary = next(line for line in out.splitlines() if line.startswith("CUDA: "))
    assert "0 grid kernels (0 cooperative), 0 grid syncs, 0 of 13 TEs (0%) inside grid kernels, 13 fallbacks" \
        in summary
    assert out.count(f"fallback: ") == 13 and f"{report.FAILED}: ValueError: lowering refused" in out


def test_souffle_compile_names_each_fallbacks_kernel_and_reason_and_none_when_all_lowers(monkeypatch, tmp_path,
                                                                                          capsys):
    """`souffle compile --target h100` on a tiny MMoE: one grid kernel and no fallback line when it lowers;
    a `fallback: <kernel>: <reason>` line for each of the plan's kernels when the grid kernel fails."""
    import onnx

    from souffle_py import cli

    path = tmp_path / "mmoe.onnx"
    onnx.save(build_model("mmoe", tiny=True), path)
    monkeypatch.setenv("SOUFFLE_COMPILE_CACHE", "0")
    monkeypatch.delenv(STRICT_ENV, raising=False)
    assert cli.main(["compile", str(path), "--target", "h100"]) == 0
    out = capsys.readouterr().out
    (line,) = [l for l in out.splitlines() if l.startswith("CUDA: ")]
    assert line.startswith("CUDA: 1 launches per inference, 1 grid kernels (1 cooperative), ")
    assert line.endswith("13 of 13 TEs (100%) inside grid kernels, 0 fallbacks") and "fallback: " not in out

    _failing_lowering(monkeypatch, "no lowering here")
    plan = souffle_py.optimize(build_model("mmoe", tiny=True), target="h100").plan
    assert cli.main(["compile", str(path), "--target", "h100"]) == 0
    out = capsys.readouterr().out
    lines = [l for l in out.splitlines() if l.startswith("fallback: ")]
    assert lines == [f"fallback: {c.name}: {c.reason}" for c in plan.calls] and len(lines) == len(plan.calls) > 1
    assert lines[0] == f"fallback: {plan.calls[0].name}: program start; {report.FAILED}: ValueError: no lowering here"
    assert f"0 grid kernels (0 cooperative), 0 grid syncs, 0 of 13 TEs (0%) inside grid kernels, " \
           f"{len(lines)} fallbacks" in out
