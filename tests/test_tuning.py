"""MetaSchedule tuning: a small GEMM is tuned into a database once, then only looked up."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import te, topi

from souffle_py.schedule.default import schedule_cpu
from souffle_py.schedule.tuning import (apply_database, database_path, is_compute_intensive, open_database, tune,
                                       tuned_or_default)
from souffle_py.target import resolve_target

TARGET = resolve_target("llvm")


def gemm(m: int, k: int, n: int) -> tvm.tirx.PrimFunc:
    a = te.placeholder((m, k), name="A")
    b = te.placeholder((k, n), name="B")
    r = te.reduce_axis((0, k), name="k")
    c = te.compute((m, n), lambda i, j: te.sum(a[i, r] * b[r, j], axis=r), name="C")
    return te.create_prim_func([a, b, c])


def relu(n: int) -> tvm.tirx.PrimFunc:
    x = te.placeholder((n,), name="X")
    return te.create_prim_func([x, te.compute((n,), lambda i: te.max(x[i], 0.0), name="Y")])


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """A database holding 8 trials of a 64x64x64 GEMM (tuned once for the module: ~20 s on 2 cores)."""
    database_dir = tmp_path_factory.mktemp("tuning")
    return database_dir, tune({"gemm": gemm(64, 64, 64)}, TARGET, database_dir, trials=8, quiet=True)


def run_gemm(func, a, b):
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=TARGET)
    dev = tvm.cpu()
    c = tvm.runtime.empty((a.shape[0], b.shape[1]), "float32", dev)
    lib["main"](tvm.runtime.tensor(a, dev), tvm.runtime.tensor(b, dev), c)
    return c.numpy()


def test_compute_intensive_kernels_are_the_matrix_products():
    x = te.placeholder((1, 4, 8, 8), name="x")
    w = te.placeholder((8, 4, 3, 3), name="w")
    conv = te.create_prim_func([x, w, topi.nn.conv2d_nchw(x, w, 1, 1, 1)])  # pad + conv stages
    assert is_compute_intensive(gemm(8, 8, 8)) and is_compute_intensive(conv)
    assert not is_compute_intensive(relu(8))
    assert not is_compute_intensive(te.create_prim_func([x, topi.sum(x, axis=1)]))


def test_tuned_gemm_matches_numpy(tuned):
    _, funcs = tuned
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((64, 64)).astype("float32") for _ in range(2))
    assert not tvm_ffi.structural_equal(funcs["gemm"], gemm(64, 64, 64))  # really scheduled
    np.testing.assert_allclose(run_gemm(funcs["gemm"], a, b), a @ b, rtol=1e-5, atol=1e-4)


def test_second_tune_reuses_the_database(tuned):
    database_dir, funcs = tuned
    records = len(open_database(database_dir, TARGET))
    again = tune({"same_gemm": gemm(64, 64, 64)}, TARGET, database_dir, trials=8, quiet=True)
    assert len(open_database(database_dir, TARGET)) == records  # nothing measured
    assert tvm_ffi.structural_equal(again["same_gemm"], funcs["gemm"])
    assert tvm_ffi.structural_equal(apply_database(gemm(64, 64, 64), TARGET, database_dir), funcs["gemm"])


def test_tuned_or_default_falls_back_to_the_default_schedule(tuned, tmp_path):
    database_dir, funcs = tuned
    schedule = tuned_or_default(database_dir, TARGET, schedule_cpu)
    assert tvm_ffi.structural_equal(schedule(gemm(64, 64, 64)), funcs["gemm"])
    untuned = gemm(32, 64, 16)
    assert apply_database(untuned, TARGET, database_dir) is None
    assert tvm_ffi.structural_equal(schedule(untuned), schedule_cpu(untuned))
    # an absent database is a fallback too, and looking it up creates nothing
    assert tvm_ffi.structural_equal(tuned_or_default(tmp_path / "none", TARGET, schedule_cpu)(untuned), schedule_cpu(untuned))
    assert not (tmp_path / "none").exists()


def _record_lines(database_dir) -> int:
    records = database_path(database_dir, TARGET) / "database_tuning_record.json"
    return len(records.read_text().splitlines()) if records.exists() else 0


def test_second_compile_reads_the_database_and_tunes_nothing(tmp_path, capsys):
    """optimize(trials=N) tunes its single-stage compute-intensive kernels; compiling again with the same
    database only looks them up."""
    import souffle_py
    from models.registry import build_model
    from souffle_py.baselines import OnnxRuntimeModel

    proto = build_model("mmoe", tiny=True)
    first = souffle_py.optimize(proto, merge=False, trials=8, database=tmp_path)
    recorded = _record_lines(tmp_path)
    assert recorded > 0
    capsys.readouterr()
    second = souffle_py.optimize(proto, merge=False, trials=8, database=tmp_path)
    assert _record_lines(tmp_path) == recorded
    assert "0 to tune" in capsys.readouterr().out
    feeds = second.random_feeds()
    expected = OnnxRuntimeModel(proto).run(feeds)
    for model in (first, second):
        for name, value in model.run(feeds).items():
            np.testing.assert_allclose(value, expected[name], rtol=1e-4, atol=1e-5)
