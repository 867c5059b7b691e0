"""cpu_peak.py: the FMA kernel computes its chains with FMA instructions, and its rate is what the CPU backend
reports as the peak profile() and the benchmark tables rate kernels against."""

import math
import platform

import numpy as np
import pytest
import tvm

from souffle_py.backends import backend_for
from souffle_py.backends.cpu import host_target
from souffle_py.backends.cpu_peak import CHAINS, fma_peak_kernel, measured_peak_gflops
from souffle_py.schedule.blocks import vector_lanes

VECTOR = vector_lanes()  # the host's: what a test outside cpu_target.using compiles for


def _build(threads, steps):
    return tvm.compile(tvm.IRModule({"main": fma_peak_kernel(threads, VECTOR, steps)}), target=host_target())


def test_each_thread_runs_its_chains():
    threads, steps = 2, 3
    out = tvm.runtime.empty((threads, CHAINS * VECTOR), "float32", tvm.cpu())
    _build(threads, steps)["main"](out)
    expected = np.zeros((threads, CHAINS, VECTOR), "float32")
    for p in range(threads):
        for c in range(CHAINS):
            value = np.float32(p + c + 1)
            for _ in range(steps):
                value = value * np.float32(0.9999999) + np.float32(1e-7)
            expected[p, c] = value
    np.testing.assert_allclose(out.numpy(), expected.reshape(threads, -1), rtol=1e-6)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 FMA mnemonics")
def test_the_chains_compile_to_fma_instructions():
    assert _build(2, 8).mod.inspect_source("asm").count("vfmadd") >= CHAINS


def test_the_cpu_backend_reports_a_measured_rate_and_a_gpu_backend_none():
    peak = backend_for("llvm").peak_gflops()
    assert isinstance(peak, float) and peak > 0 and math.isfinite(peak)
    assert measured_peak_gflops(host_target(), 1) > 0
    assert backend_for("h100").peak_gflops() is None
