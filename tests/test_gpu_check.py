"""scripts/gpu_check.py without a GPU: what needs no device runs (compile for cuda, nvcc, resource
figures, readiness, export and load without nvcc), the report marks the device columns "no GPU", and the
run exits 2. Tiny LSTM only (every part's jobs), so that this stays within a minute or so."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from gpu_util import HAS_GPU

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "scripts")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpu-check")
    out, work = folder / "out", folder / "work"
    done = subprocess.run([sys.executable, os.path.join(SCRIPTS, "gpu_check.py"), "--out", str(out), "--work",
                           str(work), "--part", "all", "--tiny", "--models", "lstm", "--budget-s", "400"],
                          capture_output=True, text=True, cwd=ROOT)
    with open(out / "gpu-report.json") as f:
        report = json.load(f)
    return done, report, (out / "gpu-report.md").read_text(), work


@pytest.mark.skipif(HAS_GPU, reason="the compile-only half of gpu_check.py (a GPU machine runs the device half)")
def test_compile_only_run_exits_2_with_the_report(run):
    done, report, md, _ = run
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    results = {r["job"]["name"]: r for r in report["results"]}
    assert set(results) == {"correctness lstm tiny merged", "correctness lstm tiny no grid sync",
                            "correctness lstm tiny unfused", "bench lstm tiny", "ablation lstm tiny"}
    assert all(r["status"] == "done" for r in results.values()), [r.get("error") for r in results.values()]
    merged = results["correctness lstm tiny merged"]["steps"]
    assert merged["compile"]["kernel_calls"] == 1 and merged["compile"]["grid_syncs"] > 0
    assert merged["compile"]["grid_registers"] and merged["compile"]["spill_bytes"] >= 0
    ready = merged["readiness"]
    assert ready["grid_kernels"] == ready["tagged"] == ready["fit"] >= 1 and not ready["problems"]
    assert merged["reload"]["ok"] and merged["device"]["status"] == "no GPU"
    unfused = results["correctness lstm tiny unfused"]["steps"]["compile"]
    assert unfused["cooperative"] == 0 and unfused["launches"] > merged["compile"]["launches"]
    ablation = results["ablation lstm tiny"]["steps"]
    assert len([k for k, v in ablation.items() if "kernel_calls" in v]) == 5
    assert ablation["V3: + partition and merging"]["cached"]  # the merged correctness compile, reused
    assert "| lstm | tiny | merged | 1 | " in md and "| lstm | tiny | no GPU | no GPU | no GPU | no GPU |" in md
    assert "## Launch readiness" in md and "## Benchmarks" in md and "## Ablation" in md
    assert report["meta"]["gpu"].startswith("no GPU") and report["meta"]["jobs_finished"] == 5


@pytest.mark.skipif(HAS_GPU, reason="the compile-only half of gpu_check.py")
def test_a_second_run_loads_the_cached_models_and_resumes(run, tmp_path):
    _, _, _, work = run
    done = subprocess.run([sys.executable, os.path.join(SCRIPTS, "gpu_check.py"), "--out", str(tmp_path),
                           "--work", str(work), "--part", "correctness", "--tiny", "--models", "lstm"],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2, done.stderr[-2000:]
    with open(tmp_path / "gpu-report.json") as f:
        results = json.load(f)["results"]
    assert all(r["steps"]["compile"]["cached"] for r in results)
    resumed = subprocess.run([sys.executable, os.path.join(SCRIPTS, "gpu_check.py"), "--out", str(tmp_path),
                              "--work", str(work), "--part", "correctness", "--tiny", "--models", "lstm", "--resume"],
                             capture_output=True, text=True, cwd=ROOT)
    assert resumed.returncode == 2 and resumed.stdout.count("done earlier") == 3, resumed.stdout[-2000:]
    with open(tmp_path / "gpu-report.json") as f:
        assert all(r["resumed"] for r in json.load(f)["results"])


def test_a_budget_too_small_leaves_jobs_unrun(tmp_path):
    done = subprocess.run([sys.executable, os.path.join(SCRIPTS, "gpu_check.py"), "--out", str(tmp_path),
                           "--work", str(tmp_path / "work"), "--part", "ablation", "--tiny", "--models", "lstm",
                           "--budget-s", "5"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == (3 if HAS_GPU else 2), done.stderr[-2000:]
    with open(tmp_path / "gpu-report.json") as f:
        [result] = json.load(f)["results"]
    assert result["status"] == "not run: budget"
    assert "Not run (budget): ablation lstm tiny" in (tmp_path / "gpu-report.md").read_text()


def test_the_device_half_simulated_on_the_cpu(tmp_path):
    """SOUFFLE_GPU_CHECK_SIMULATE=cpu runs what a GPU run runs (device runs against ONNX Runtime, export
    and re-run in a fresh process, measure(), profile(), the ablation, the targets) with target llvm."""
    done = subprocess.run([sys.executable, os.path.join(SCRIPTS, "gpu_check.py"), "--out", str(tmp_path),
                           "--work", str(tmp_path / "work"), "--part", "all", "--tiny", "--models", "lstm"],
                          capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, SOUFFLE_GPU_CHECK_SIMULATE="cpu"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with open(tmp_path / "gpu-report.json") as f:
        results = {r["job"]["name"]: r["steps"] for r in json.load(f)["results"]}
    for variant in ("merged", "no grid sync", "unfused"):
        assert results[f"correctness lstm tiny {variant}"]["device"]["matches"]
    assert results["correctness lstm tiny merged"]["reload"]["identical_to_before_export"]
    bench = results["bench lstm tiny"]
    assert bench["souffle-py"]["matches"] and bench["souffle-py"]["median_ms"] > 0
    assert bench["souffle-py"]["compile_s"] is not None
    if importlib.util.find_spec("torch") is not None:  # the PyTorch rows need PyTorch (CI has none)
        assert bench["PyTorch eager"]["matches"]
    else:
        assert not [row for row in bench if row.startswith("PyTorch")]
    assert "LSTM" in bench["TVM Relax + dlight"]["error"]  # Relax has no LSTM op: a row, not a failure
    assert bench["profile"]["top"][0]["median_ms"] > 0
    ablation = results["ablation lstm tiny"]
    assert all(ablation[row]["matches"] for row in ablation if row.startswith("V"))
    md = (tmp_path / "gpu-report.md").read_text()
    assert "| LSTM under 3.27 ms" in md and "profile() of souffle-py" in md


def test_a_failing_job_is_recorded_and_the_run_goes_on(tmp_path):
    """A job that fails (here: its cached export is not a model) is reported with its error and log, and
    the other jobs still run."""
    sys.path.insert(0, SCRIPTS)
    from gpu_check_jobs import cache_path

    path = cache_path(str(tmp_path / "work"), "lstm", True, {"grid_sync": False}, target="llvm")  # simulated
    os.makedirs(os.path.dirname(path))
    with open(path, "wb") as f:
        f.write(b"not an exported model")
    done = subprocess.run([sys.executable, os.path.join(SCRIPTS, "gpu_check.py"), "--out", str(tmp_path),
                           "--work", str(tmp_path / "work"), "--part", "correctness", "--tiny", "--models", "lstm"],
                          capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, SOUFFLE_GPU_CHECK_SIMULATE="cpu"))
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    with open(tmp_path / "gpu-report.json") as f:
        results = {r["job"]["name"]: r for r in json.load(f)["results"]}
    failed = results["correctness lstm tiny no grid sync"]
    assert failed["status"] == "failed" and "ExportError" in failed["error"]
    assert results["correctness lstm tiny unfused"]["steps"]["device"]["matches"]
    assert results["correctness lstm tiny merged"]["steps"]["device"]["matches"]
    md = (tmp_path / "gpu-report.md").read_text()
    assert "## Failed or cut-off jobs" in md and "FAILED: ExportError" in md


@pytest.mark.skipif(HAS_GPU, reason="runs the GPU tests' job with them skipped")
def test_the_pytest_job_writes_each_test_into_its_log_as_it_goes(tmp_path, monkeypatch, capfd):
    """The first GPU run lost the job's whole output when its limit ended it: pytest now writes into the
    job's log (here: this process's stdout) as it goes, with a stack dump for a test stuck 120 s."""
    sys.path.insert(0, SCRIPTS)
    import gpu_check_jobs as jobs

    monkeypatch.setattr(jobs, "gpu_present", lambda: True)  # the tests themselves skip: no GPU here
    result = jobs.Result(str(tmp_path / "result.json"), {"kind": "pytest"})
    jobs.pytest_gpu({"work": str(tmp_path), "timeout": 300}, result)
    out = capfd.readouterr().out
    step = result.data["steps"]["pytest -m gpu"]
    assert "faulthandler_timeout=120" in out and "test_export.py::test_cuda_model_runs_after_load SKIPPED" in out
    assert step["returncode"] == 0 and "skipped" in step["summary"] and not step["failures"]


def test_a_failing_gpu_test_is_reported_with_its_message(tmp_path, monkeypatch):
    """The second H200 run reported a failing tensor-core test by name only: the report now carries the
    first line of its assertion (the error it measured)."""
    sys.path.insert(0, SCRIPTS)
    import gpu_check_jobs as jobs

    def pytest_that_fails(command, **kwargs):
        junit = next(arg.split("=", 1)[1] for arg in command if arg.startswith("--junitxml="))
        with open(junit, "w") as f:
            f.write('<testsuites><testsuite tests="2" failures="1" errors="0" skipped="0">'
                    '<testcase classname="tests.test_a" name="test_ok"/>'
                    '<testcase classname="tests.test_a" name="test_bound[bert-bf16]">'
                    '<failure message="AssertionError: output: max abs error 0.52&#10;assert 0.52 &lt;= 0.03"/>'
                    '</testcase></testsuite></testsuites>')
        return subprocess.CompletedProcess(command, 1)

    monkeypatch.setattr(jobs, "gpu_present", lambda: True)
    monkeypatch.setattr(jobs, "SIMULATED", False)
    monkeypatch.setattr(jobs.subprocess, "run", pytest_that_fails)
    result = jobs.Result(str(tmp_path / "result.json"), {"kind": "pytest"})
    jobs.pytest_gpu({"work": str(tmp_path), "timeout": 300}, result)
    step = result.data["steps"]["pytest -m gpu"]
    assert step["summary"] == "2 tests, 1 failures, 0 errors, 0 skipped"
    assert step["failures"] == ["tests.test_a::test_bound[bert-bf16]: AssertionError: output: max abs error 0.52"]


def test_speed_ratios_read_the_right_way_round():
    sys.path.insert(0, SCRIPTS)
    from gpu_check_report import _versus

    assert _versus(18.792, 5.782) == "3.25x slower"
    assert _versus(0.023, 0.103) == "4.48x faster"
