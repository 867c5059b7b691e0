"""benchmark.py: systems are checked against ONNX Runtime and timed in interleaved blocks."""

import time

import souffle_py
from models.registry import build_model
from souffle_py import benchmark
from souffle_py.benchmark import ORT, Row, _interleaved_medians, compute_floor, format_table, measure
from souffle_py.errors import UnsupportedError


class _Recorder:
    """Stands in for a compiled model: records the order of benchmark calls, returns fixed times."""

    def __init__(self, name, calls, ms):
        self.name, self.calls, self.ms = name, calls, ms

    def benchmark(self, feeds, repeat=10, warmup=2):
        self.calls.append((self.name, repeat, warmup))
        return {"median_ms": self.ms, "times_ms": [self.ms] * repeat}


def test_systems_alternate_in_blocks_after_warmup(monkeypatch):
    monkeypatch.setattr(benchmark, "PAUSE_MS", 0.0)
    monkeypatch.setattr(benchmark, "SETTLE_MS", 0.0)
    calls = []
    models = {"a": _Recorder("a", calls, 1.0), "b": _Recorder("b", calls, 3.0)}
    medians = _interleaved_medians(models, {}, repeat=12, warmup=2, block=5)
    assert medians == {"a": 1.0, "b": 3.0}
    warm = [("a", 1, 0)] * 2, [("b", 1, 0)] * 2
    assert calls == [*warm[0], ("a", 5, 0), *warm[1], ("b", 5, 0), *warm[0], ("a", 5, 0), *warm[1], ("b", 5, 0),
                     *warm[0], ("a", 2, 0), *warm[1], ("b", 2, 0)]


def test_each_block_follows_a_pause_and_warm_runs_of_its_own_system(monkeypatch):
    """The previous system's threads spin after its last run: two warm-up runs of a 0.45 ms model fell
    inside that spin (it timed 0.87 ms). A block now starts after a pause, then SETTLE_MS of its own runs."""
    monkeypatch.setattr(benchmark, "PAUSE_MS", 30.0)
    monkeypatch.setattr(benchmark, "SETTLE_MS", 5.0)
    stamps = []

    class Timed(_Recorder):
        def benchmark(self, feeds, repeat=10, warmup=2):
            stamps.append((self.name, repeat, time.perf_counter()))
            time.sleep(0.001 * repeat)
            return {"median_ms": self.ms, "times_ms": [self.ms] * repeat}

    _interleaved_medians({"a": Timed("a", [], 1.0), "b": Timed("b", [], 1.0)}, {}, repeat=4, warmup=2, block=2)
    for (before, _, end), (name, repeat, start) in zip(stamps, stamps[1:]):
        if name != before:  # a switch: the other system's last run ended at least PAUSE_MS before
            assert start - end >= 0.030 and repeat == 1
    blocks = [i for i, (_, repeat, _) in enumerate(stamps) if repeat > 1]
    for i in blocks:
        first = i
        while first > 0 and stamps[first - 1][0] == stamps[i][0] and stamps[first - 1][1] == 1:
            first -= 1
        assert i - first >= 2 and stamps[i][2] - stamps[first][2] >= 0.005  # warm-up runs, SETTLE_MS of them


def test_rows_check_outputs_and_report_failures():
    proto = build_model("mmoe", tiny=True)

    def refuses(_proto):
        raise UnsupportedError("node", "Op", "not supported here")

    rows = measure(proto, {"souffle-py": lambda p: souffle_py.optimize(p, quiet=True), "broken": refuses},
                   repeat=3, warmup=1, log=lambda _: None)
    by_name = {r.system: r for r in rows}
    assert rows[0].system == ORT and rows[0].median_ms > 0
    assert by_name["souffle-py"].matches and by_name["souffle-py"].kernels >= 1
    assert by_name["broken"].error and "not supported here" in by_name["broken"].error
    table = format_table("tiny mmoe", rows)
    assert "| souffle-py |" in table and "failed:" in table
    assert by_name["souffle-py"].flops > 0 and rows[0].flops is None and by_name["broken"].flops is None


def test_the_compute_floor_rates_souffle_rows_against_the_peak():
    rows = [Row(ORT, 10.0, None, 0.0, None, True), Row("souffle-py", 8.0, 12, 1e-6, 3.0, True, flops=int(1.2e9)),
            Row("broken", float("nan"), None, None, None, None, error="refused")]
    lines = compute_floor(rows, lambda single_threaded: 100.0 if single_threaded else 200.0).splitlines()
    assert lines[0] == "Measured float32 peak of these cores: 200.0 GFLOP/s."
    # 1.2 GFLOP in 8 ms: 150 GFLOP/s, 75% of the peak; at the peak 6 ms, 0.60x ONNX Runtime's 10 ms
    assert lines[1] == ("- souffle-py: 1.20 GFLOP per inference at 150.0 GFLOP/s (75% of the peak); "
                        "at that peak 6 ms, 0.60x ONNX Runtime")
    assert len(lines) == 2
    assert compute_floor(rows, lambda _: None) == "" and compute_floor(rows[:1], lambda _: 200.0) == ""
    tiny = [rows[0], Row("souffle-py", 0.5, 1, 0.0, 0.1, True, flops=int(20e6), single_threaded=True)]
    lines = compute_floor(tiny, lambda single_threaded: 100.0 if single_threaded else 200.0).splitlines()
    assert lines[0].endswith("100.0 GFLOP/s on the one thread a model of little work runs on.")
    assert "at 40.0 GFLOP/s (40% of the one-thread peak)" in lines[1]


def test_gpu_tables_show_grid_syncs_and_ratios_to_another_reference():
    rows = [Row(ORT, 10.0, None, 0.0, None, True), Row("TVM Relax + dlight", 4.0, 228, 1e-6, 3.0, True),
            Row("souffle-py", 2.0, 24, 1e-6, 5.0, True, grid_syncs=300)]
    table = format_table("bert, cuda", rows, reference_system="TVM Relax + dlight")
    assert "| vs TVM Relax + dlight |" in table and "grid syncs" in table
    assert "| souffle-py | 2.000 | 0.50x | 24 | 300 |" in table


def test_busy_cores_are_reported_before_timing(monkeypatch):
    """Other processes on the cores make TVM's statically shared loops wait: the tables say so."""
    import souffle_py.benchmark as benchmark

    assert benchmark.busy_cores(0.05) is None or benchmark.busy_cores(0.05) >= 0.0
    proto = build_model("mmoe", tiny=True)
    for busy, warned in ((1.0, True), (0.0, False)):
        monkeypatch.setattr(benchmark, "busy_cores", lambda busy=busy: busy)
        lines = []
        measure(proto, {"souffle-py": lambda p: souffle_py.optimize(p, quiet=True)}, repeat=2, warmup=1,
                log=lines.append)
        assert any("warning: other processes kept 1.0" in line for line in lines) == warned
