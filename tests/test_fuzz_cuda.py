"""No internal errors on the GPU path either: the random graphs of test_fuzz.py compiled for CUDA (an H100,
no GPU needed) give kernels or a SouffleError; where every kernel is grid-synchronized, the kernels run
on the CPU phase by phase (what their barriers guarantee; blocks and warps in a shuffled order within a
phase) match ONNX Runtime."""

from __future__ import annotations

import logging

import numpy as np
from hypothesis import HealthCheck, given, settings

import souffle_py
from gpu_util import run_phases_on_cpu
from souffle_py.backends import backend_for
from souffle_py.backends.cuda.grid import grid_blocks
from souffle_py.baselines import OnnxRuntimeModel
from souffle_py.codegen.build import schedule_kernels
from souffle_py.errors import SouffleError
from test_fuzz import RTOL, ATOL, _feeds, graphs

EXAMPLES = 40


def _on_cpu(compiled):
    """The compiled model's grid kernels, scheduled again, built for the CPU and run phase by phase."""
    backend = backend_for("h100")
    scheduled = schedule_kernels(compiled.kernels, backend.default_scheduler())
    return run_phases_on_cpu(compiled.program, compiled.kernels, scheduled.functions, scheduled.function_of,
                             reverse=True)


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large])
@given(graphs())
def test_random_graphs_compile_for_cuda_or_raise_souffle_errors(case):
    model, broken = case
    logging.disable(logging.WARNING)
    try:
        compiled = souffle_py.optimize(model, target="h100", quiet=True)
    except SouffleError:
        return
    finally:
        logging.disable(logging.NOTSET)
    assert not broken, "a deliberately broken graph compiled"
    assert compiled.device_source() or not compiled.kernels
    if not all(grid_blocks(k.func) is not None for k in compiled.kernels):
        return  # dlight kernels cooperate through shared memory: not runnable thread by thread
    feeds = _feeds(model)
    try:
        reference = OnnxRuntimeModel(model, threads=1).run(feeds)
    except Exception:
        return
    ours = _on_cpu(compiled).run(feeds)
    for name, expected in reference.items():
        np.testing.assert_allclose(ours[name], expected, rtol=RTOL, atol=ATOL, equal_nan=True, err_msg=name)
