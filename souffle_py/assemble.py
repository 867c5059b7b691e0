"""A compiled model from scheduled kernels: build them, then write the plan the runtime follows. Apart from
the driver (api.py) so that tools below it (te_passes/check.py's numeric check, the baselines) assemble
models without importing the pipeline that runs them."""

from __future__ import annotations

import logging
import time

from souffle_py.backends.base import Backend
from souffle_py.plan import plan_for
from souffle_py.runtime import CompiledModel

log = logging.getLogger("souffle_py")


def build_model(program, kernels, backend: Backend, schedule, start: float, fast_math: bool = True,
                precision: str = "fp32", notes: tuple[str, ...] = ()) -> CompiledModel:
    """Schedule, compile and wrap kernels; `start` is when the compilation began (for compile_seconds);
    `notes`: the compile's own, beside the backend's, for the plan."""
    built, finished = backend.build(kernels, schedule, fast_math)
    log.info("built %d kernel calls (%d distinct) in %.1fs", len(kernels), built.distinct, built.seconds)
    plan = plan_for(program, kernels, built.function_of, built.distinct, backend.target, backend.device,
                    finished.launches, finished.binary_key, finished.notes + tuple(notes), precision,
                    backend.describe())
    return CompiledModel(plan, built.module, program.params, kernels=kernels, program=program,
                         compile_seconds=time.perf_counter() - start, device_source=finished.source,
                         device_binary=finished.binary, scheduled_functions=built.functions)
