"""Compile-time readiness of CUDA models for a GPU, checked without one: grid-syncing kernels carry the
cooperative-launch tag and fit the occupancy of an H100 and an A100 (backends/cuda/readiness.py); an
exported model's device binary is the one loaded, with no compiler at hand; the first device error of a
run names its kernel (launch_check.py)."""

import dataclasses
import os
import subprocess
import sys
import tarfile

import numpy as np
import pytest

import souffle_py
from models.registry import build_model
from souffle_py.backends.cuda import nvcc
from souffle_py.backends.cuda.readiness import COOPERATIVE_TAG, check_grids, grid_sync_kernels, launch_tags
from souffle_py.errors import DeviceError, SouffleError
from souffle_py.launch_check import LaunchChecker
from souffle_py.partition import A100, H100

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def exported(tmp_path, name, target, **config):
    model = souffle_py.optimize(build_model(name, tiny=True, **config), target=target, quiet=True)
    path = tmp_path / f"{name}-{target}.tar"
    model.export(path)
    with tarfile.open(path) as archive:
        library = archive.extractfile("kernels.so").read()
    return model, path, library


@pytest.mark.parametrize("name", ["bert", "lstm", "mmoe"])
@pytest.mark.parametrize("target,gpu,spec", [("h100", "H100", H100), ("a100", "A100", A100)])
def test_grid_kernels_are_cooperative_and_fit_their_gpu(tmp_path, name, target, gpu, spec):
    model, _, library = exported(tmp_path, name, target)
    rows = check_grids(model.plan, model.device_source(), library, {gpu: spec})
    assert rows and all(r.cooperative_tag for r in rows), rows
    assert all(r.fits[gpu] and r.resident[gpu] >= 1 for r in rows), [p for r in rows for p in r.problems()]
    assert {r.kernel for r in rows} == grid_sync_kernels(model.device_source())
    assert {r.kernel for r in rows} == {l.kernel for c in model.plan.calls for l in c.launches if l.cooperative}


def test_a_missing_tag_or_an_oversized_grid_is_reported(tmp_path):
    model, _, library = exported(tmp_path, "bert", "h100")  # one grid kernel of 162 blocks
    untagged = library.replace(COOPERATIVE_TAG.encode(), b"tirx.use_ordinary_launch___")  # same length
    kernel = next(iter(grid_sync_kernels(model.device_source())))
    assert launch_tags(library, [kernel])[kernel][-1] == COOPERATIVE_TAG
    [row] = check_grids(model.plan, model.device_source(), untagged, {"H100": H100})
    assert not row.cooperative_tag and any("lacks the 'tirx.use_cooperative_launch' tag" in p for p in row.problems())
    tiny_gpu = dataclasses.replace(H100, name="one SM", sms=1)
    [row] = check_grids(model.plan, model.device_source(), library, {"one SM": tiny_gpu})
    assert row.blocks > row.resident["one SM"] and not row.fits["one SM"]
    assert any("does not fit" in p and kernel in p for p in row.problems())


def test_grid_sync_kernels_reads_the_kernels_that_call_the_barrier():
    source = ('__device__ void tvm_builtin_cuda_grid_sync() { cg::this_grid().sync(); }\n'
              'extern "C" __global__ void __launch_bounds__(256) a_kernel(float* x) {\n x[0] = 1;\n}\n'
              'extern "C" __global__ void __launch_bounds__(256, 2) b_kernel(float* x) {\n'
              '  tvm_builtin_cuda_grid_sync();\n}\n')
    assert grid_sync_kernels(source) == {"b_kernel"}


def test_export_loads_its_binary_with_nvcc_absent(tmp_path):
    """A fresh process without nvcc (SOUFFLE_NVCC=none, none on PATH): the callback TVM's CUDA runtime calls
    at load returns the exported binary for the library's source, and would refuse to compile another."""
    model, path, library = exported(tmp_path, "mmoe", "cuda")
    assert library.find(model.device_source().encode()) >= 0  # the source TVM's runtime holds
    script = f"""
import tvm_ffi, souffle_py
from souffle_py.backends.cuda.nvcc import register_binary
from souffle_py.errors import SouffleError
m = souffle_py.load({str(path)!r})
register_binary(m.plan.device_binary, m.device_binary())   # what load() does before TVM loads the library
compile = tvm_ffi.get_global_func("tvm_callback_cuda_compile")
assert bytes(compile(m.device_source())) == m.device_binary()
try:
    compile(m.device_source() + "// another source")
except Exception as exc:
    assert "nvcc is disabled" in str(exc), exc
    print("refused")
"""
    path_without_nvcc = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                                        if not os.path.exists(os.path.join(p, "nvcc")))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, SOUFFLE_NVCC="none", PATH=path_without_nvcc))
    assert done.returncode == 0 and "refused" in done.stdout, done.stderr[-2000:]


def test_souffle_nvcc_chooses_or_disables_the_compiler(monkeypatch):
    monkeypatch.setenv(nvcc.NVCC_ENV, "none")
    with pytest.raises(SouffleError, match="nvcc is disabled"):
        nvcc.nvcc_path()
    monkeypatch.setenv(nvcc.NVCC_ENV, "/nonexistent/nvcc")
    with pytest.raises(SouffleError, match="not an executable nvcc"):
        nvcc.nvcc_path()


# --- the first device error names its kernel ----------------------------------------------------------------
class FakeDevice:
    """Kernels that run asynchronously: a faulting kernel's error shows at the next synchronization."""

    def __init__(self, faulting=None, launch_error=None):
        self.faulting, self.launch_error, self.pending = faulting, launch_error, None
        self.launched = []

    def kernel(self, name):
        def launch():
            if self.pending:
                raise RuntimeError("CUDA: unspecified launch failure")  # a poisoned context
            if name == self.launch_error:
                raise RuntimeError("CUDA: too many blocks in cooperative launch")
            self.launched.append(name)
            if name == self.faulting:
                self.pending = name
        return launch, []

    def sync(self):
        if self.pending:
            raise RuntimeError("CUDA: an illegal memory access was encountered")


def test_first_run_pins_a_fault_to_its_kernel_and_refuses_later_runs():
    device = FakeDevice(faulting="k1")
    names = ["k0", "k1", "k2"]
    checker = LaunchChecker(names, device.sync, "cuda")
    with pytest.raises(DeviceError, match="kernel call 'k1' failed on the cuda device: .*illegal memory") as info:
        checker.run([device.kernel(n) for n in names])
    assert info.value.kernel == "k1" and device.launched == ["k0", "k1"]
    with pytest.raises(DeviceError, match="'k1'.*earlier run failed.*fresh process"):
        checker.run([device.kernel(n) for n in names])
    with pytest.raises(DeviceError, match="earlier run failed"):
        with checker.guard("copying the outputs"):
            pass


def test_later_runs_say_where_an_error_surfaced(monkeypatch):
    device = FakeDevice()
    names = ["k0", "k1", "k2"]
    checker = LaunchChecker(names, device.sync, "cuda")
    checker.run([device.kernel(n) for n in names])  # the checked first run
    device.faulting = "k0"
    with pytest.raises(DeviceError, match="surfaced at kernel call 'k1'.*SOUFFLE_CHECK_LAUNCHES") as info:
        checker.run([device.kernel(n) for n in names])
    assert info.value.kernel is None
    monkeypatch.setenv("SOUFFLE_CHECK_LAUNCHES", "1")
    device, checker = FakeDevice(), LaunchChecker(names, FakeDevice().sync, "cuda")
    checker.run([device.kernel(n) for n in names])
    device.launch_error = "k2"
    with pytest.raises(DeviceError, match="kernel call 'k2' failed.*cooperative launch"):
        checker.run([device.kernel(n) for n in names])


def test_runtime_wraps_a_failing_kernel_call():
    """CompiledModel.run goes through the checker: a TVM error in a kernel call becomes a DeviceError
    naming the call, and the model refuses to run again."""
    model = souffle_py.optimize(build_model("mmoe", tiny=True), quiet=True)
    feeds = model.random_feeds()
    expected = model.run(feeds)
    name = model.plan.calls[-1].name

    def broken(*args):
        raise RuntimeError("TVMError: CUDA: unspecified launch failure")

    with model.workspace() as ws:  # the pool's only workspace: the next run takes it
        ws.calls[-1] = (broken, ws.calls[-1][1])
    with pytest.raises(DeviceError, match=f"surfaced at kernel call '{name}'"):
        model.run(feeds)
    with pytest.raises(DeviceError, match="earlier run failed"):
        model.benchmark(feeds, repeat=1)
    fresh = souffle_py.optimize(build_model("mmoe", tiny=True), quiet=True)
    np.testing.assert_array_equal(fresh.run(feeds)[next(iter(expected))], expected[next(iter(expected))])
