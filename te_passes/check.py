"""Numerical check of a transformation: run a program before and after on the same inputs and compare.

The isl checks prove that every rewritten TE reads the right elements; this runs the programs (each TE its
own kernel, default CPU schedules) to confirm the values too. Used by the tests and for debugging a pass.
"""

from __future__ import annotations

import time
from typing import Mapping

import numpy as np

from souffle_py.ir.program import TEProgram


def run_program(program: TEProgram, feeds: Mapping[str, np.ndarray], target: str = "llvm") -> dict[str, np.ndarray]:
    """The program's outputs on `feeds`, every TE compiled as its own kernel."""
    from souffle_py.assemble import build_model
    from souffle_py.backends import backend_for

    backend = backend_for(target)
    kernels = backend.unfused_kernels(program, fast_math=True)
    model = build_model(program, kernels, backend, backend.default_scheduler(), time.perf_counter())
    return model.run(feeds)


def assert_same_outputs(before: TEProgram, after: TEProgram, feeds: Mapping[str, np.ndarray] | None = None,
                        rtol: float = 1e-5, atol: float = 1e-6) -> dict[str, np.ndarray]:
    """Raise AssertionError unless both programs compute the same outputs; returns `after`'s outputs."""
    feeds = before.random_feeds() if feeds is None else feeds
    expected, got = run_program(before, feeds), run_program(after, feeds)
    assert list(expected) == list(got), f"outputs differ: {list(expected)} vs {list(got)}"
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=rtol, atol=atol, err_msg=f"output '{name}'")
    return got


def assert_same_models(before, after, seed: int = 0, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Raise AssertionError unless two ONNX models (before and after an ONNX-level pass) give the same
    outputs under ONNX Runtime on the same random feeds."""
    import onnxruntime as ort
    from onnx import helper

    sessions = [ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]) for m in (before, after)]
    rng = np.random.default_rng(seed)
    feeds = {}
    for value in sessions[0].get_inputs():
        elem = next(i for i in before.graph.input if i.name == value.name).type.tensor_type.elem_type
        dtype = helper.tensor_dtype_to_np_dtype(elem)
        shape = [d if isinstance(d, int) else 1 for d in value.shape]
        feeds[value.name] = (rng.standard_normal(shape).astype(dtype) if np.dtype(dtype).kind == "f"
                             else rng.integers(0, 2, shape).astype(dtype))
    expected, got = (s.run(None, feeds) for s in sessions)
    for value, e, g in zip(sessions[0].get_outputs(), expected, got):
        np.testing.assert_allclose(g, e, rtol=rtol, atol=atol, err_msg=f"output '{value.name}'")
