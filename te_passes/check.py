"""Numerical check of a transformation: run a program before and after on the same inputs and compare.

The isl checks prove that every rewritten TE reads the right elements; this runs the programs (each TE its
own kernel, default CPU schedules) to confirm the values too. Used by the tests and for debugging a pass.
"""

from __future__ import annotations

import time
from typing import Mapping

import numpy as np

from souffle_py.program import TEProgram


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
