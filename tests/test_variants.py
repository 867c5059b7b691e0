"""schedule/variants.py: default schedule variants of conv/GEMM stages measured once at compile time and
kept in the tuning database; a second compile measures nothing. No timing assertions."""

import numpy as np

import souffle_py
from models.patterns import asymmetric
from souffle_py.schedule import tuning, variants
from souffle_py.schedule.conv import Variant
from tests.onnx_cases import assert_matches_ort


def test_second_compile_measures_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(variants, "MEASURE_MIN_FLOPS", 0)  # the tiny stages count as large enough
    measured = []
    real = tuning._measure

    def counting(schedules, funcs, target, **options):
        measured.append(len(schedules))
        return real(schedules, funcs, target, **options)
    monkeypatch.setattr(tuning, "_measure", counting)
    model, feeds = asymmetric(32, 9)
    first = souffle_py.optimize(model, database=str(tmp_path), quiet=True)
    assert measured and measured[0] >= 2  # at least one stage with two differing variants, measured
    assert any((tmp_path / variants.VARIANTS_FOLDER).iterdir())  # recorded in the persistent database, beside
    assert [p.name for p in tmp_path.iterdir()] == [variants.VARIANTS_FOLDER]  # the tuned records, not among
    # them: `souffle tune` still tunes these stages
    measured.clear()
    second = souffle_py.optimize(model, database=str(tmp_path), quiet=True)
    assert measured == []  # every stage has its record: nothing measured again
    expected = first.run(feeds)
    for name, value in second.run(feeds).items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-5, atol=1e-5)
    assert_matches_ort(model, feeds)


def test_small_stages_are_not_measured(tmp_path, monkeypatch):
    monkeypatch.setattr(tuning, "_measure", lambda *a: (_ for _ in ()).throw(AssertionError("measured")))
    model, feeds = asymmetric(32, 9)  # every stage far below MEASURE_MIN_FLOPS
    souffle_py.optimize(model, database=str(tmp_path), quiet=True).run(feeds)


def test_variants_differ_and_the_default_comes_first():
    assert variants.schedule_variants()[0] == Variant()
    assert len(set(variants.schedule_variants())) == len(variants.schedule_variants()) <= 4  # a small, bounded choice


def test_a_rival_replaces_the_default_only_when_clearly_faster(tmp_path):
    """Within DEFAULT_MARGIN the default wins and only the workload is recorded (no record to replay: the
    default rules schedule the stage in its kernel, epilogue fused); a rival clearly faster is recorded."""
    from tests.test_staged import gemm_then_relu
    from souffle_py.schedule.stages import compute_stages
    from souffle_py.target import resolve_target
    target = resolve_target("llvm")
    func = compute_stages(gemm_then_relu())[0].func
    schedules = [(v, tuning._scheduled(func, lambda s, v=v: variants._apply(s, v))) for v in variants.schedule_variants()[:2]]
    close = tuning.open_database(tmp_path / "close", target)
    variants._record(close, func, schedules, [[1.0], [1.0 / (0.5 + variants.DEFAULT_MARGIN / 2)]], target)
    assert close.has_workload(tuning.workload(func)) and not tuning.best_traces(close, func)
    clear = tuning.open_database(tmp_path / "clear", target)
    variants._record(clear, func, schedules, [[1.0], [0.5 / variants.DEFAULT_MARGIN]], target)
    assert len(tuning.best_traces(clear, func)) >= 1


def test_a_measurement_leaves_no_build_behind(tmp_path, monkeypatch):
    """Each variant's build is a directory of its own in the temporary folder: removed once measured (each
    compile that measured variants left some 30 there)."""
    import tempfile

    from souffle_py.schedule.stages import compute_stages
    from souffle_py.schedule.staged import default_stage_schedule
    from souffle_py.target import resolve_target
    from tests.test_staged import gemm_then_relu
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the builder's workers start after this, with it
    monkeypatch.setattr(tempfile, "tempdir", None)
    func = compute_stages(gemm_then_relu())[0].func
    sch = tuning._scheduled(func, default_stage_schedule)
    (secs,) = tuning._measure([sch], [func], resolve_target("llvm"), rounds=1)
    assert secs[0] is not None and secs[0][0] > 0
    assert list(tmp_path.iterdir()) == []


def test_a_rival_winning_within_the_rounds_spread_is_measured_again(tmp_path, monkeypatch):
    """A rival that beats the default by less than the spread of its rounds changes nothing yet: no record,
    the next compile measures the stage again, at most MAX_RETRIES times, then the choice is recorded."""
    from tests.test_staged import gemm_then_relu
    from souffle_py.schedule.stages import compute_stages

    func = compute_stages(gemm_then_relu())[0].func
    schedules = [(v, tuning._scheduled(func, lambda s, v=v: variants._apply(s, v))) for v in variants.schedule_variants()[:2]]
    rival = 1.0 / variants.DEFAULT_MARGIN / 1.10          # 10% faster than the default, after its handicap
    assert variants._within_spread(schedules, [[1.0, 1.3, 1.0], [rival, rival, rival]])  # default's rounds: 30%
    assert not variants._within_spread(schedules, [[1.0, 1.02, 1.0], [rival, rival * 1.01, rival]])
    assert not variants._within_spread(schedules, [[1.0, 1.3], [2.0, 2.0]])  # the default wins: nothing to redo

    monkeypatch.setattr(variants, "MEASURE_MIN_FLOPS", 0)
    monkeypatch.setattr(variants, "_within_spread", lambda schedules, times: True)  # every choice a close one
    calls = []

    def measure(schedules, funcs, target, rounds=1, **options):
        calls.append(len(schedules))
        return [[[1e-3] for _ in schedules] for _ in range(rounds)]
    monkeypatch.setattr(tuning, "_measure", measure)
    model, _ = asymmetric(32, 9)
    measured = []
    for _ in range(variants.MAX_RETRIES + 2):
        calls.clear()
        souffle_py.optimize(model, database=str(tmp_path), quiet=True)
        measured.append(len(calls))
    assert measured == [1] * (variants.MAX_RETRIES + 1) + [0]  # measured again twice, then recorded

    from souffle_py.target import resolve_target
    target, fresh = resolve_target("llvm"), tmp_path / "fresh"
    kernels = souffle_py.optimize(model, quiet=True, cache=False, database=str(fresh)).kernels
    provisional = variants.provisional_database()
    assert variants.choose_variants(kernels, target, fresh / "again", provisional=provisional) >= 1
    kept = tuning.open_database(variants.variants_dir(fresh / "again"), target)
    stages = [stage.func for kernel in kernels for stage in compute_stages(kernel.func)]
    assert any(provisional.has_workload(tuning.workload(f)) for f in stages)  # this compile's choice ...
    assert not any(kept.has_workload(tuning.workload(f)) for f in stages)     # ... not the database's
