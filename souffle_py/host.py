"""The host's thread count for TVM's CPU runtime: a leaf module, so that tuning and baselines can ask it
without importing a backend."""

from __future__ import annotations

import os


def num_threads() -> int:
    """Threads for TVM's CPU runtime: TVM_NUM_THREADS, else every core (TVM's own default halves it)."""
    return int(os.environ.get("TVM_NUM_THREADS", os.cpu_count() or 1))


def cache_bytes(level: int, default: int) -> int:
    """Size of the CPU cache of `level` from sysfs (Linux), else `default`."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for entry in sorted(os.listdir(base)):
            with open(f"{base}/{entry}/level") as f:
                if int(f.read()) != level:
                    continue
            with open(f"{base}/{entry}/size") as f:
                text = f.read().strip()
            scale = {"K": 1024, "M": 1024 ** 2}.get(text[-1], 1)
            return int(text.rstrip("KM")) * scale
    except (OSError, ValueError):
        pass
    return default
