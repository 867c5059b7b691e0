"""The jobs of scripts/gpu_check.py, each run in a fresh process (`gpu_check.py --worker JOB RESULT`), so
that a launch error, a mismatch or a poisoned CUDA context ends one job and not the run.

A job writes its result (JSON) after each step, so that a job killed at the time budget still leaves
what it measured. Compiled models are exported into the work folder's cache, keyed by the compile
options and the source of souffle_py/, so that a later part (or a later device call on the same machine)
loads them instead of compiling again. Device work runs under one file lock: jobs compile in parallel,
and only one of them touches the GPU at a time.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from contextlib import contextmanager
from xml.etree import ElementTree

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

os.environ.setdefault("SOUFFLE_COMPILE_CACHE", "0")  # compile times are measured: every compile a real one
import souffle_py  # noqa: E402
from models.registry import build_model  # noqa: E402

RTOL, ATOL = 1e-4, 1e-4           # float32 against ONNX Runtime, O(1) outputs (the GPU tests' tolerance)
FP16_TOLERANCE = 5e-2             # PyTorch's float16 rows: max abs diff allowed, O(1) outputs
NO_GPU = "no GPU"
# SOUFFLE_GPU_CHECK_SIMULATE=cpu runs the device half on the CPU (target llvm; PyTorch eager on the CPU):
# the test of the GPU run's own machinery (jobs, device lock, measure, profile, reload, report) without a GPU
SIMULATED = os.environ.get("SOUFFLE_GPU_CHECK_SIMULATE", "") == "cpu"
TARGET = "llvm" if SIMULATED else "cuda"
VARIANTS = {                      # correctness: how each variant is compiled
    "merged": {},
    "no grid sync": {"grid_sync": False},
    "unfused": {"merge": False},
}
ABLATION = {                      # bench.py's ablation rows (the paper's Table 4), same options
    "V0: no transforms (every TE a kernel)": {"passes": "V0", "merge": False},
    "V1: + horizontal": {"passes": "V1", "merge": False},
    "V2: + vertical": {"passes": "V2", "merge": False},
    "V3: + partition and merging": {},  # passes="all" is V2: the merged correctness variant, same cache
    "V3's stages as separate kernels (no grid sync)": {"grid_sync": False},
}
MODELS = {                        # bench.py's names: (builder, config overrides)
    "bert": ("bert", {}), "lstm": ("lstm", {}), "lstm-unrolled": ("lstm", {"spelling": "unrolled"}),
    "resnext": ("resnext", {}), "efficientnet": ("efficientnet", {}), "swin": ("swin", {}),
    "mmoe": ("mmoe", {}), "sbert": ("sbert", {}),
}


# --- shared plumbing -----------------------------------------------------------------------------------------
def gpu_present() -> bool:
    """Whether the device half runs: a GPU, or the CPU simulating one."""
    from souffle_py.backends.cuda.specs import gpu_present as present

    return SIMULATED or present()


def source_digest() -> str:
    """A digest of souffle_py/ and te_passes/: cached models compiled by other code are not reused."""
    digest = hashlib.sha256()
    for folder in ("souffle_py", "te_passes"):
        for base, dirs, files in sorted(os.walk(os.path.join(ROOT, folder))):
            dirs.sort()
            for name in sorted(f for f in files if f.endswith(".py")):
                with open(os.path.join(base, name), "rb") as f:
                    digest.update(name.encode() + f.read())
    return digest.hexdigest()[:16]


@contextmanager
def device_lock(work: str):
    """One job at a time on the GPU (the others keep compiling)."""
    with open(os.path.join(work, "device.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class Result:
    """A job's result, written to disk after every update."""

    def __init__(self, path: str, job: dict):
        self.path = path
        self.data = {"job": job, "steps": {}}
        self.save()

    def step(self, name: str, **values) -> dict:
        self.data["steps"].setdefault(name, {}).update(values)
        self.save()
        return self.data["steps"][name]

    def save(self) -> None:
        with open(self.path + ".tmp", "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        os.replace(self.path + ".tmp", self.path)


def error_text(exc: BaseException) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}"[:400]


def proto_of(model: str, tiny: bool):
    builder, overrides = MODELS[model]
    return build_model(builder, tiny=tiny, **overrides)


def compile_figures(model) -> dict:
    """What the compile says about the kernels: calls, launches, grid syncs, registers, spills, shared."""
    launches = [l for call in model.plan.calls for l in call.launches]
    registers = sorted({l.registers for l in launches if l.registers is not None})
    cooperative = [l for l in launches if l.cooperative]
    return {
        "kernel_calls": len(model.plan.calls), "launches": model.num_kernels, "distinct": model.plan.distinct,
        "cooperative": len(cooperative), "grid_syncs": model.grid_syncs,
        "registers": registers, "grid_registers": sorted({l.registers for l in cooperative if l.registers}),
        "spill_bytes": sum(l.spill_bytes or 0 for l in launches),
        "max_shared_bytes": max((l.shared_bytes or 0 for l in launches), default=0),
        "resident_blocks_per_sm": sorted({l.resident_blocks_per_sm for l in cooperative
                                          if l.resident_blocks_per_sm is not None}),
    }


def cache_path(work: str, model: str, tiny: bool, options: dict, target: str = TARGET) -> str:
    """Where the export of `model` compiled with `options` (for `target`, by this source) is cached."""
    key = hashlib.sha256(json.dumps([source_digest(), target, model, tiny, sorted(options.items())]).encode())
    return os.path.join(work, "models", f"{model}-{'tiny' if tiny else 'paper'}-{key.hexdigest()[:20]}.tar")


def compiled(work: str, model: str, tiny: bool, options: dict, result: Result, step: str):
    """(CompiledModel, tar path): loaded from the work folder's cache, else compiled here and exported
    into it. The step records compile time (or that the model came from the cache) and its figures."""
    tar = cache_path(work, model, tiny, options)
    if os.path.exists(tar):
        loaded = souffle_py.load(tar)
        result.step(step, cached=True, compile_s=json.loads(_member(tar, "figures.json") or "{}").get("compile_s"),
                    **compile_figures(loaded))
        return loaded, tar
    start = time.perf_counter()
    print(f"compiling {model} ({'tiny' if tiny else 'paper size'}) for {TARGET}", flush=True)
    made = souffle_py.optimize(proto_of(model, tiny), target=TARGET, quiet=True, **options)
    compile_s = time.perf_counter() - start
    print(f"compiled in {compile_s:.1f} s; exporting", flush=True)  # the log's tail says how far a cut job got
    result.step(step, cached=False, compile_s=round(compile_s, 1), **compile_figures(made))
    os.makedirs(os.path.dirname(tar), exist_ok=True)
    part = f"{tar}.{os.getpid()}.part"  # two jobs compiling the same model each write their own, then replace
    made.export(part)
    with tarfile.open(part, "a") as archive:  # the compile time, for a later part's report
        data = json.dumps({"compile_s": round(compile_s, 1)}).encode()
        info = tarfile.TarInfo("figures.json")
        info.size = len(data)
        archive.addfile(info, io.BytesIO(data))
    os.replace(part, tar)
    return made, tar


def _member(tar: str, name: str) -> str | None:
    with tarfile.open(tar) as archive:
        try:
            return archive.extractfile(name).read().decode()
        except KeyError:
            return None


def readiness(tar: str) -> dict:
    """The exported model's grid-syncing kernels: cooperative tag, and grid against the compile target."""
    from souffle_py.backends import backend_for
    from souffle_py.backends.cuda.readiness import check_grids
    from souffle_py.runtime import load

    loaded = load(tar)
    spec = backend_for("cuda").spec  # the present GPU's, else the H100's: what "cuda" compiled for
    library = _member_bytes(tar, "kernels.so")
    rows = check_grids(loaded.plan, loaded.device_source(), library, {spec.name: spec})
    return {"gpu": spec.name, "grid_kernels": len(rows), "tagged": sum(r.cooperative_tag for r in rows),
            "fit": sum(r.fits[spec.name] for r in rows), "problems": [p for r in rows for p in r.problems()]}


def _member_bytes(tar: str, name: str) -> bytes:
    with tarfile.open(tar) as archive:
        return archive.extractfile(name).read()


def compare(outputs: dict, expected: dict, tolerance: float | None = None) -> dict:
    diff = max(float(np.max(np.abs(outputs[k].astype(np.float64) - v))) if v.size else 0.0
               for k, v in expected.items())
    ok = (diff <= tolerance if tolerance is not None else
          all(np.allclose(outputs[k], v, rtol=RTOL, atol=ATOL) for k, v in expected.items()))
    return {"max_abs_diff": diff, "matches": bool(ok)}


# --- correctness ---------------------------------------------------------------------------------------------
def correctness(job: dict, result: Result) -> None:
    """One model, size and variant: compile (or load from the cache), run on the GPU against ONNX
    Runtime; the merged variant also loads its export in a fresh process with nvcc disabled and runs it."""
    from souffle_py.baselines import OnnxRuntimeModel

    work, name, tiny, variant = job["work"], job["model"], job["tiny"], job["variant"]
    model, tar = compiled(work, name, tiny, VARIANTS[variant], result, "compile")
    if variant == "merged" and not SIMULATED:
        result.step("readiness", **readiness(tar))
    if not gpu_present():
        result.step("device", status=NO_GPU)
        if variant == "merged":
            result.step("reload", **reload_check(tar, None, work))
        return
    feeds = model.random_feeds(seed=0)
    expected = OnnxRuntimeModel(proto_of(name, tiny)).run(feeds)
    print("ONNX Runtime ran; waiting for the device", flush=True)
    with device_lock(work):
        print("running on the device", flush=True)
        outputs = model.run(feeds)
        timing = model.benchmark(feeds, repeat=5)
    result.step("device", status="ran", median_ms=timing["median_ms"], **compare(outputs, expected))
    if variant == "merged":
        reference = os.path.join(work, f"expected-{os.path.basename(tar)}.npz")
        np.savez(reference, **{f"ort::{k}": v for k, v in expected.items()},
                 **{f"run::{k}": v for k, v in outputs.items()}, **{f"feed::{k}": v for k, v in feeds.items()})
        result.step("reload", **reload_check(tar, reference, work))


def reload_check(tar: str, reference: str | None, work: str) -> dict:
    """Load the export in a fresh process whose nvcc is disabled (SOUFFLE_NVCC=none, and no nvcc on PATH):
    on a GPU run it (same outputs as before export, and ONNX Runtime's); without one, check that the
    compile callback TVM calls at load returns the exported device binary."""
    env = dict(os.environ, SOUFFLE_NVCC="none",
               PATH=os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                                    if not os.path.exists(os.path.join(p, "nvcc"))))
    command = [sys.executable, os.path.abspath(__file__), "--reload", tar] + ([reference] if reference else [])
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"ok": False, "error": (done.stderr.strip().splitlines() or ["no output"])[-1][:400]}
    return json.loads(lines[-1])


def reload_main(tar: str, reference: str | None) -> int:
    """The fresh process of reload_check."""
    loaded = souffle_py.load(tar)
    if reference is None:  # no GPU: what TVM's runtime would get for the module's source at load
        import tvm_ffi

        from souffle_py.backends.cuda.nvcc import register_binary

        source, binary = loaded.device_source(), loaded.device_binary()
        in_library = _member_bytes(tar, "kernels.so").find(source.encode()) >= 0  # what TVM's runtime holds
        register_binary(loaded.plan.device_binary, binary)  # what load() does before TVM loads the library
        given = bytes(tvm_ffi.get_global_func("tvm_callback_cuda_compile")(source))
        print(json.dumps({"ok": in_library and given == binary, "source_in_library": in_library,
                          "how": "no GPU: with nvcc disabled, the compile callback TVM calls at load returned "
                                 "the exported binary for the source in the library"}))
        return 0
    with np.load(reference) as saved:
        feeds = {k[6:]: saved[k] for k in saved.files if k.startswith("feed::")}
        before = {k[5:]: saved[k] for k in saved.files if k.startswith("run::")}
        expected = {k[5:]: saved[k] for k in saved.files if k.startswith("ort::")}
    outputs = loaded.run(feeds)
    same = all(np.array_equal(outputs[k], v) for k, v in before.items())
    print(json.dumps({"ok": same and compare(outputs, expected)["matches"], "identical_to_before_export": same,
                      "how": "loaded and run in a fresh process with nvcc disabled",
                      **compare(outputs, expected)}))
    return 0


# --- bench and ablation --------------------------------------------------------------------------------------
def measured_systems(job: dict, result: Result, systems: dict) -> None:
    """Compile every system (souffle-py's from the cache), then, holding the device, time them side by side
    with ONNX Runtime (benchmark.measure: interleaved rounds, medians, outputs checked) and profile
    souffle-py's kernels."""
    from souffle_py.benchmark import measure

    proto = proto_of(job["model"], job.get("tiny", False))
    built, failed = {}, {}
    for name, factory in systems.items():
        start = time.perf_counter()
        try:
            built[name] = factory(proto)
            if "compile_s" not in result.data["steps"].get(name, {}):  # souffle-py's: from its compile
                result.step(name, compile_s=round(time.perf_counter() - start, 1))
        except Exception as exc:  # a baseline that cannot compile this model is a row, not the end
            failed[name] = error_text(exc)
            result.step(name, error=failed[name])
    if not gpu_present():
        for name in built:
            result.step(name, status=NO_GPU)
        return
    with device_lock(job["work"]):
        rows = measure(proto, {name: (lambda p, m=model: m) for name, model in built.items()},
                       repeat=job.get("repeat", 20), log=lambda line: None)
        souffle = next((m for n, m in built.items() if n.startswith("souffle-py") or n.startswith("V3: ")), None)
        profile = souffle.profile(repeat=10) if souffle is not None else []
    for row in rows:
        fp16 = "fp16" in row.system
        matches = (row.max_abs_diff is not None and row.max_abs_diff <= FP16_TOLERANCE) if fp16 else row.matches
        result.step(row.system, median_ms=row.median_ms, kernels=row.kernels, grid_syncs=row.grid_syncs,
                    max_abs_diff=row.max_abs_diff, matches=matches, tolerance="5e-2 abs (fp16)" if fp16 else "1e-4",
                    **({"error": row.error} if row.error else {}))
    if profile:
        result.step("profile", top=[{k: r[k] for k in ("kernel", "tes", "median_ms", "share", "alone_ms")}
                                    for r in profile[:8]])


def bench(job: dict, result: Result) -> None:
    """souffle-py against TVM Relax + dlight (with and without CUDA graphs) and PyTorch (eager, CUDA graph,
    torch.compile; float32, and float16 where the model's inputs are floats)."""
    from souffle_py.baselines import relax_tvm

    work, name = job["work"], job["model"]
    souffle, _ = compiled(work, name, job.get("tiny", False), {}, result, "souffle-py")
    if not gpu_present():  # the baselines' runtimes (Relax's VM, PyTorch's CUDA modes) need the device
        for system in ("souffle-py", "TVM Relax + dlight", "TVM Relax + dlight, CUDA graph", "PyTorch"):
            result.step(system, status=NO_GPU)
        return
    systems = {"souffle-py": lambda proto: souffle,
               "TVM Relax + dlight": lambda proto: relax_tvm(proto, TARGET),
               "TVM Relax + dlight, CUDA graph": lambda proto: relax_tvm(proto, TARGET, cuda_graph=True),
               **torch_systems(proto_of(name, job.get("tiny", False)))}
    measured_systems(job, result, systems)


def torch_systems(proto) -> dict:
    from souffle_py.baselines_torch import SYSTEM_NAMES, TorchModel, torch_available

    if not torch_available():
        return {}
    floats = all(i.type.tensor_type.elem_type == 1 for i in proto.graph.input
                 if i.name not in {t.name for t in proto.graph.initializer})
    systems = {}
    modes = ("eager",) if SIMULATED else tuple(SYSTEM_NAMES)  # the simulation: eager on the CPU
    for dtype in ("float32", "float16") if floats else ("float32",):
        for mode in modes:
            label = f"{SYSTEM_NAMES[mode]}{' fp16' if dtype == 'float16' else ''}"
            systems[label] = lambda p, mode=mode, dtype=dtype: TorchModel(p, mode=mode, dtype=dtype,
                                                                         device="cpu" if SIMULATED else "cuda")
    return systems


def ablation(job: dict, result: Result) -> None:
    """V0-V3 and V3's stages launched separately (bench.py's ablation rows), from the cache if compiled."""
    systems = {}
    for row, options in ABLATION.items():
        model, _ = compiled(job["work"], job["model"], job.get("tiny", False), options, result, row)
        systems[row] = lambda proto, model=model: model
    measured_systems(job, result, systems)


def pytest_gpu(job: dict, result: Result) -> None:
    """`pytest -m gpu tests`: every test that needs the GPU (skipped, and said so, without one)."""
    if not gpu_present() or SIMULATED:
        result.step("pytest -m gpu", status=NO_GPU)
        return
    modules = sorted(os.path.join("tests", name) for name in os.listdir(os.path.join(ROOT, "tests"))
                     if name.startswith("test_") and name.endswith(".py")
                     and "pytest.mark.gpu" in open(os.path.join(ROOT, "tests", name)).read())
    # only the modules with GPU tests: the others may import packages the GPU machine lacks (timm, openvino).
    # pytest writes into the job's log, unbuffered, as it goes (-v: each test's name as it starts), so the
    # tail the runner keeps when it ends the job names the test that was running, and a test still running
    # after FAULT_S seconds dumps every thread's stack there too: the first GPU run lost everything to
    # capture_output when its job was ended at its limit. The tiny models' merged / no-grid-sync / unfused
    # runs are the correctness part's own jobs and are not repeated here (27 compiles of ~25 s each on the
    # GPU machine: more than the job's limit).
    report = os.path.join(job.get("work", tempfile.gettempdir()), "pytest-gpu.xml")
    command = [sys.executable, "-m", "pytest", "-v", "-m", "gpu", "-p", "no:cacheprovider", "-o",
               f"faulthandler_timeout={FAULT_S}", f"--junitxml={report}",
               "-k", "not test_models_match_onnx_runtime_on_the_gpu", *modules]
    print("$", " ".join(command), flush=True)
    if os.path.exists(report):
        os.remove(report)
    done = subprocess.run(command, stdout=sys.stdout.fileno(), stderr=subprocess.STDOUT, cwd=ROOT,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"), timeout=job.get("timeout", 540))
    summary, failures = "", []
    if os.path.exists(report):
        suite = ElementTree.parse(report).getroot()
        suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
        summary = ", ".join(f"{suite.get(key)} {key}" for key in ("tests", "failures", "errors", "skipped"))
        failures = [f"{case.get('classname')}::{case.get('name')}: {_first_line(problem.get('message'))}"
                    for case in suite.iter("testcase")
                    for problem in _problems(case)[:1]]
    result.step("pytest -m gpu", status="ran", returncode=done.returncode, summary=summary,
                modules=modules, failures=failures[:20])


def _problems(case) -> list:
    """A junit test case's failure and error elements (an Element without children is false: no `or`)."""
    return [element for element in (case.find("failure"), case.find("error")) if element is not None]


def _first_line(message: str | None) -> str:
    """A failure's message as one line of the report (the assertion's text, e.g. the error it measured)."""
    return ((message or "").strip().splitlines() or ["(no message)"])[0][:300]


FAULT_S = 120  # pytest's faulthandler_timeout: a test running this long dumps its stack into the job's log


JOBS = {"correctness": correctness, "bench": bench, "ablation": ablation, "pytest": pytest_gpu}


def worker_main(job_path: str, result_path: str) -> int:
    with open(job_path) as f:
        job = json.load(f)
    result = Result(result_path, job)
    try:
        JOBS[job["kind"]](job, result)
    except Exception as exc:
        result.data["error"] = error_text(exc)
        result.data["traceback"] = traceback.format_exc()[-3000:]
        result.save()
        return 1
    return 0


def probe() -> dict:
    """What TVM's CUDA runtime sees, asked in a process of its own (gpu_check.py's own process holds no
    CUDA context, which a GPU in an exclusive compute mode would give to it alone)."""
    if SIMULATED or not gpu_present():
        return {"present": gpu_present()}
    import tvm

    device = tvm.cuda(0)
    return {"present": True, "name": device.device_name, "sms": int(device.multi_processor_count),
            "compute_capability": device.compute_version}


if __name__ == "__main__":
    if sys.argv[1] == "--probe":
        print(json.dumps(probe()))
        sys.exit(0)
    if sys.argv[1] == "--reload":
        sys.exit(reload_main(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None))
    sys.exit(worker_main(sys.argv[1], sys.argv[2]))
