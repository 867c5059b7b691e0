"""The host's float32 FMA peak, measured: the roof that `profile()` rates each kernel call against.

Why measured: a datasheet peak assumes a clock that a shared, virtualized 2-core host does not hold, and
whether a model can still gain (from tuning, say) depends on how far its GEMMs are from what the cores
really do. The kernel keeps CHAINS independent FMA chains of one vector each per thread, enough to cover
the FMA latency on every x86 core TVM targets, so it runs at the FMA units' throughput and touches no
memory. On the 2-core Zen 4 host: 230-234 GFLOP/s (gcc's -mavx512f loop of the same chains: 225-228).

The bf16 peak (`measured_bf16_peak_gflops`) is the same measurement for `vdpbf16ps` (AVX512_BF16), the
instruction of the bf16 GEMM micro-kernel (schedule/bf16_gemm.py): the roof of a model compiled with
precision="bf16". On the busy 2-core Zen 5 host it measured 1.8-2.2x the float32 FMA peak.
"""

from __future__ import annotations

import statistics
import time

import tvm
from tvm.script import tirx as T

from souffle_py.schedule.bf16_gemm import DPBF16PS_LLVM
from souffle_py.cpu_target import CpuTarget

CHAINS = 12            # independent accumulators per thread: FMA latency (4) x FMA ports (2), and some
STEPS = 1 << 22        # FMA rounds per call: ~15 ms
RUNS = 5               # timed calls; the median counts


def fma_peak_kernel(threads: int, lanes: int | None = None, steps: int = STEPS) -> tvm.tirx.PrimFunc:
    """`threads` parallel iterations, each running CHAINS chains of `steps` vector FMAs of `lanes` lanes (by
    default a vector of the current CpuTarget)."""
    lanes = lanes or CpuTarget.current().lanes
    width = CHAINS * lanes
    output = T.Buffer((threads, width), "float32")  # outside the annotation: pyflakes reads its strings as names

    @T.prim_func
    def fma_peak(out: output):
        for p in T.parallel(threads):
            acc = T.alloc_buffer((width,), "float32", scope="local")
            for c in T.unroll(CHAINS):
                for lane in T.vectorized(lanes):
                    acc[c * lanes + lane] = T.Cast("float32", p + c + 1)
            for _ in range(steps):
                for c in T.unroll(CHAINS):
                    for lane in T.vectorized(lanes):
                        acc[c * lanes + lane] = acc[c * lanes + lane] * T.float32(0.9999999) + T.float32(1e-7)
            for c in T.unroll(CHAINS):
                for lane in T.vectorized(lanes):
                    out[p, c * lanes + lane] = acc[c * lanes + lane]

    return fma_peak


def measured_peak_gflops(target: tvm.target.Target, threads: int) -> float:
    """The float32 GFLOP/s of `threads` cores running only FMAs compiled for `target` (the host), median of
    RUNS calls (a multiply-add counts two, as in the kernels' figures)."""
    lanes = CpuTarget.from_target(target).lanes
    func = tvm.compile(tvm.IRModule({"main": fma_peak_kernel(threads, lanes)}), target=target)["main"]
    out = tvm.runtime.empty((threads, CHAINS * lanes), "float32", tvm.cpu())
    func(out)  # starts the thread pool
    seconds = []
    for _ in range(RUNS):
        start = time.perf_counter()
        func(out)
        seconds.append(time.perf_counter() - start)
    return 2 * threads * CHAINS * lanes * STEPS / statistics.median(seconds) / 1e9


DOT_FLOPS = 64  # one vdpbf16ps: 16 lanes x 2 products x (multiply + add)


def bf16_peak_kernel(threads: int, steps: int = STEPS // 2) -> tvm.tirx.PrimFunc:
    """`threads` parallel iterations, each running CHAINS chains of `steps` vdpbf16ps (the bf16 GEMM's
    micro-kernel instruction, through the same imported LLVM function: schedule/bf16_gemm.py)."""
    width = CHAINS * 16
    output = T.Buffer((threads, width), "float32")

    @T.prim_func
    def bf16_peak(out: output):
        for p in T.parallel(threads, annotations={"pragma_import_llvm": DPBF16PS_LLVM}):
            acc = T.alloc_buffer((width,), "float32", scope="local")
            for c in T.unroll(CHAINS):
                for lane in T.vectorized(16):
                    acc[c * 16 + lane] = T.Cast("float32", p + c + 1)
            for _ in range(steps):
                for c in T.unroll(CHAINS):
                    acc[T.ramp(c * 16, 1, 16)] = T.call_pure_extern(
                        "float32x16", "souffle_dpbf16ps", acc[T.ramp(c * 16, 1, 16)],
                        T.broadcast(T.int32(0x3F803F80), 16), T.broadcast(T.int32(0x33803380), 16))
            for c in T.unroll(CHAINS):
                for lane in T.vectorized(16):
                    out[p, c * 16 + lane] = acc[c * 16 + lane]

    return bf16_peak


def measured_bf16_peak_gflops(target: tvm.target.Target, threads: int) -> float:
    """The bfloat16 dot-product GFLOP/s of `threads` cores running only vdpbf16ps chains (AVX512_BF16),
    median of RUNS calls; each instruction counts DOT_FLOPS, as the bf16 GEMMs' figures count theirs."""
    steps = STEPS // 2
    func = tvm.compile(tvm.IRModule({"main": bf16_peak_kernel(threads, steps)}), target=target)["main"]
    out = tvm.runtime.empty((threads, CHAINS * 16), "float32", tvm.cpu())
    func(out)
    seconds = []
    for _ in range(RUNS):
        start = time.perf_counter()
        func(out)
        seconds.append(time.perf_counter() - start)
    return DOT_FLOPS * threads * CHAINS * steps / statistics.median(seconds) / 1e9
