"""The host's thread count for TVM's CPU runtime: a leaf module, so that tuning and baselines can ask it
without importing a backend."""

from __future__ import annotations

import os


def num_threads() -> int:
    """Threads for TVM's CPU runtime: TVM_NUM_THREADS, else every core (TVM's own default halves it)."""
    return int(os.environ.get("TVM_NUM_THREADS", os.cpu_count() or 1))
