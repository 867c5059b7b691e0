"""What the host offers TVM's CPU runtime (threads, CPU features LLVM's CPU name leaves out): a leaf module,
so that tuning and baselines can ask it without importing a backend."""

from __future__ import annotations

import os

from souffle_py.errors import InputError

# the cores this process may run on, before TVM's thread pool pins its threads (set_num_threads)
_ALLOWED_CPUS = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None


def set_num_threads(count: int) -> None:
    """Run CPU kernels on `count` threads from now on (TVM_NUM_THREADS only counts when TVM starts its thread
    pool). On cores shared with other work, use the ones you can count on: TVM shares each parallel loop
    out statically, so a preempted thread stalls every launch (BERT-base beside one busy process on 2
    cores: 746 ms on 2 threads, 179 ms on one)."""
    from souffle_py.tvm_runtime import ffi

    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise InputError(f"set_num_threads() needs a positive number of threads, got {count!r}")
    os.environ["TVM_NUM_THREADS"] = str(count)  # num_threads(), new targets and ONNX Runtime baselines follow
    if _ALLOWED_CPUS:  # a pool of one pins this thread to one core, and TVM sizes a new pool by its affinity
        os.sched_setaffinity(0, _ALLOWED_CPUS)
    ffi().get_global_func("runtime.config_threadpool")(1, count)  # 1: TVM's default affinity mode (big cores)


def num_threads() -> int:
    """Threads for TVM's CPU runtime: TVM_NUM_THREADS, else every core (TVM's own default halves it)."""
    return int(os.environ.get("TVM_NUM_THREADS", os.cpu_count() or 1))


# CPUID flags (/proc/cpuinfo) -> LLVM features that the CPU name LLVM reports may leave out
CPUINFO_FEATURES = {"avx512_bf16": "+avx512bf16"}


def missing_cpu_features(reported: set[str], cpuinfo: str = "/proc/cpuinfo") -> list[str]:
    """LLVM features the host has (its CPUID flags in `cpuinfo`) but the CPU name LLVM reports lacks
    (`reported`, e.g. tvm.target.codegen.llvm_get_cpu_features): a VM that masks the CPU model (an AVX512_BF16
    Xeon reporting model 167) gets the name "rocketlake", which has no AVX512_BF16. [] where unreadable."""
    try:
        with open(cpuinfo) as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []
    return [feature for flag, feature in CPUINFO_FEATURES.items()
            if flag in flags and feature.lstrip("+") not in reported]
