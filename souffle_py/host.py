"""What the host offers TVM's CPU runtime (threads, CPU features LLVM's CPU name leaves out): a leaf module,
so that tuning and baselines can ask it without importing a backend."""

from __future__ import annotations

import os


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
