"""Tuning through a TVM RPC tracker on loopback (schedule/runners.py): a tracker and two CPU rpc_servers
started with TVM's own modules, a tiny model tuned through them, its records replayed without tuning; a
server killed mid-tune, every server gone, an unreachable tracker, a key without servers; the database
files repaired after an interrupted tune (schedule/records.py)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from tvm import te

from souffle_py.backends import backend_for
from souffle_py.errors import NoRpcServersError, TrackerUnreachableError
from souffle_py.schedule import runners, tuning
from souffle_py.schedule.records import repair
from souffle_py.schedule.runners import RpcTracker
from rpc_util import LocalPool, free_port, tracker_available

TARGET = backend_for("llvm").target
needs_tracker = pytest.mark.skipif(tracker_available() is not None, reason=str(tracker_available()))


def gemm(m: int, k: int, n: int):
    a = te.placeholder((m, k), name="A")
    b = te.placeholder((k, n), name="B")
    r = te.reduce_axis((0, k), name="k")
    return te.create_prim_func([a, b, te.compute((m, n), lambda i, j: te.sum(a[i, r] * b[r, j], axis=r), name="C")])


def records(database_dir) -> int:
    path = tuning.database_path(database_dir, TARGET) / "database_tuning_record.json"
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """A tracker and two servers for the module; stopped by their process ids at the end."""
    pool = LocalPool(tmp_path_factory.mktemp("rpc"), servers=2)
    yield pool
    pool.stop()


def kill_after_first_measurement(pool: LocalPool, server) -> threading.Thread:
    """Kill `server` (its whole process group) once it has measured a candidate."""
    def watch():
        deadline = time.monotonic() + 120
        while pool.measured(server) == 0 and server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        pool.kill(server)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def tiny_model():
    """x [8, 64] @ w [64, 48], then Relu: one GEMM stage to tune."""
    from onnx import TensorProto, helper, numpy_helper

    weight = numpy_helper.from_array(np.random.default_rng(0).standard_normal((64, 48)).astype("float32"), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
                               helper.make_node("Relu", ["h"], ["y"], name="relu")], "tiny",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 48])], [weight])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@needs_tracker
def test_a_model_tuned_on_two_servers_is_replayed_without_tuning(pool, tmp_path, capsys):
    """`souffle tune --rpc-tracker --rpc-key` measures on both servers; a later compile with the database
    (and no tracker) replays the records and measures nothing."""
    import onnx

    import souffle_py
    from souffle_py import cli
    from souffle_py.baselines import OnnxRuntimeModel

    proto = tiny_model()
    onnx.save(proto, tmp_path / "tiny.onnx")
    before = [pool.measured(s) for s in pool.servers]
    assert cli.main(["tune", str(tmp_path / "tiny.onnx"), "--trials", "8", "--database", str(tmp_path),
                     "--rpc-tracker", pool.address, "--rpc-key", pool.key]) == 0
    assert "measuring on the 2 server(s)" in capsys.readouterr().out
    first = souffle_py.optimize(proto, database=tmp_path)
    measured = [pool.measured(s) - b for s, b in zip(pool.servers, before)]
    assert all(count > 0 for count in measured), f"candidates measured per server: {measured}"
    recorded = records(tmp_path)
    assert recorded > 0
    capsys.readouterr()
    # a second compile anywhere with that database: no tracker needed, nothing measured
    second = souffle_py.optimize(proto, trials=8, database=tmp_path)
    assert "0 to tune" in capsys.readouterr().out
    assert records(tmp_path) == recorded
    assert [pool.measured(s) for s in pool.servers] == [b + m for b, m in zip(before, measured)]
    feeds = second.random_feeds()
    expected = OnnxRuntimeModel(proto).run(feeds)
    for model in (first, second):
        for name, value in model.run(feeds).items():
            np.testing.assert_allclose(value, expected[name], rtol=1e-4, atol=1e-5)


@needs_tracker
def test_a_server_killed_mid_tune_leaves_the_tune_to_the_others(pool, tmp_path):
    doomed = pool.add_server()
    pool.wait_for_servers(3)
    watcher = kill_after_first_measurement(pool, doomed)
    tuned = tuning.tune({"gemm": gemm(32, 48, 40)}, TARGET, tmp_path, trials=8, trials_per_round=4, quiet=True,
                        runner=RpcTracker.parse(pool.address, pool.key))
    watcher.join()
    assert doomed.poll() is not None  # it really died during the tune
    assert "gemm" in tuned and records(tmp_path) >= 4
    pool.wait_for_servers(2)


@needs_tracker
def test_every_server_gone_stops_the_tune_and_keeps_its_records(pool, tmp_path):
    lonely = pool.add_server_under("lonely")
    watcher = kill_after_first_measurement(pool, lonely)
    with pytest.raises(NoRpcServersError, match="lonely"):
        tuning.tune({"gemm": gemm(24, 40, 56)}, TARGET, tmp_path, trials=32, trials_per_round=4, quiet=True,
                    runner=RpcTracker.parse(pool.address, "lonely"))
    watcher.join()
    assert tuning.open_database(tmp_path, TARGET, create=False) is not None  # loadable, whatever was recorded


@needs_tracker
def test_a_key_without_servers_fails_before_building(pool, tmp_path):
    with pytest.raises(NoRpcServersError, match="no server under key 'gpu-nobody'"):
        tuning.tune({"gemm": gemm(16, 16, 16)}, TARGET, tmp_path, trials=8, quiet=True,
                    runner=RpcTracker.parse(pool.address, "gpu-nobody"))
    assert records(tmp_path) == 0


def test_an_unreachable_tracker_is_named(tmp_path):
    runner = RpcTracker("127.0.0.1", free_port(), "cpu")
    start = time.monotonic()
    with pytest.raises(TrackerUnreachableError, match="cannot reach the RPC tracker"):
        tuning.tune({"gemm": gemm(16, 16, 16)}, TARGET, tmp_path, trials=8, quiet=True, runner=runner)
    assert time.monotonic() - start < runners.CONNECT_TIMEOUT_S


def test_a_lost_server_is_retried_and_a_failing_candidate_is_not(monkeypatch):
    from tvm.s_tir.meta_schedule.runner import rpc_runner

    calls = []

    def flaky(*args):
        calls.append(args)
        if len(calls) == 1:
            raise ConnectionResetError("Connection reset by peer")
        return [1e-3]

    monkeypatch.setattr(rpc_runner, "_worker_func", flaky)
    monkeypatch.setattr(runners, "_servers_of", lambda config: 1)
    monkeypatch.setattr(runners.time, "sleep", lambda s: None)
    assert runners.measure_remotely(None, None, 3, "c.so", "cpu", ()) == [1e-3] and len(calls) == 2

    def wrong(*args):
        calls.append(args)
        raise ValueError("the candidate computed nonsense")

    calls.clear()
    monkeypatch.setattr(rpc_runner, "_worker_func", wrong)
    with pytest.raises(ValueError):
        runners.measure_remotely(None, None, 3, "c.so", "cpu", ())
    assert len(calls) == 1

    def lost(*args):
        calls.append(args)
        raise ConnectionResetError("Connection reset by peer")

    calls.clear()
    monkeypatch.setattr(rpc_runner, "_worker_func", lost)
    with pytest.raises(RuntimeError, match="measured on 3 servers"):
        runners.measure_remotely(None, None, 3, "c.so", "cpu", ())
    assert len(calls) == 3


def test_tracker_addresses_are_checked():
    assert RpcTracker.parse("10.0.0.2:9190", "h100") == RpcTracker("10.0.0.2", 9190, "h100")
    from souffle_py.errors import InputError

    for address, key in (("10.0.0.2", "h100"), ("10.0.0.2:port", "h100"), ("10.0.0.2:9190", "")):
        with pytest.raises(InputError):
            RpcTracker.parse(address, key)


def test_an_interrupted_tune_leaves_a_loadable_database(tmp_path):
    """A half-written last record is dropped, a complete one without its newline kept (records.py)."""
    from tvm import s_tir

    tuned_dir = tmp_path / "db"
    database = tuning.open_database(tuned_dir, TARGET)
    for size, secs in ((16, 1e-6), (24, 2e-6), (32, 3e-6)):  # records as a tune commits them, unmeasured
        func = gemm(size, 16, 16)
        tuning._commit(database, func, s_tir.Schedule(tuning.workload(func)), [secs], TARGET)
    folder = tuning.database_path(tuned_dir, TARGET)
    path = folder / "database_tuning_record.json"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines) + "\n" + lines[-1][: len(lines[-1]) // 2])  # killed mid-line
    assert repair(folder) == 1
    assert len(tuning.open_database(tuned_dir, TARGET)) == len(lines)
    path.write_text("\n".join(lines))  # killed before the newline
    assert repair(folder) == 0 and path.read_text().endswith("\n")
    assert len(tuning.open_database(tuned_dir, TARGET)) == len(lines)


def test_the_command_line_checks_its_tracker_flags(tmp_path, capsys):
    from souffle_py import cli

    model = str(tmp_path / "absent.onnx")  # the flags are checked before the model is read
    assert cli.main(["tune", model, "--trials", "8", "--rpc-key", "cpu"]) == 2
    assert "--rpc-key needs --rpc-tracker" in capsys.readouterr().err
    assert cli.main(["compile", model, "--trials", "8", "--rpc-tracker", "127.0.0.1:9190"]) == 2
    assert "--rpc-key" in capsys.readouterr().err


def test_optimize_refuses_a_runner_it_does_not_know():
    import souffle_py
    from souffle_py.errors import InputError

    with pytest.raises(InputError, match="RpcTracker"):
        souffle_py.optimize(tiny_model(), trials=8, runner="127.0.0.1:9190")


def test_a_database_tvm_refuses_is_set_aside_and_started_anew(tmp_path, caplog):
    """Records pointing at a workload the folder does not hold (two processes appending at once made them)
    made every later compile die opening the folder: it is moved to damaged-* with a warning naming it, and
    an empty database serves the compile (records.py)."""
    from tvm import s_tir

    tuned_dir = tmp_path / "db"
    database = tuning.open_database(tuned_dir, TARGET)
    func = gemm(16, 16, 16)
    tuning._commit(database, func, s_tir.Schedule(tuning.workload(func)), [1e-6], TARGET)
    folder = tuning.database_path(tuned_dir, TARGET)
    path = folder / "database_tuning_record.json"
    line = path.read_text().splitlines()[0]
    path.write_text(line + "\n" + "[99" + line[line.index(","):] + "\n")  # a record of workload 99 of 1
    with caplog.at_level("WARNING"):
        reopened = tuning.open_database(tuned_dir, TARGET)
    assert len(reopened) == 0
    assert "could not be read" in caplog.text and str(folder) in caplog.text
    aside = [p for p in folder.iterdir() if p.name.startswith("damaged-")]
    assert len(aside) == 1 and (aside[0] / "database_tuning_record.json").exists()
