"""Merging TEs into one PrimFunc preserves semantics: merged kernels equal the unfused program."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from models.registry import build_model
from souffle_py.baselines import unfused_tvm
from souffle_py.assemble import build_model as build_compiled
from souffle_py.backends import backend_for
from souffle_py.codegen.merge import merged_kernel
from souffle_py.codegen.unfused import unfused_kernels
from souffle_py.errors import SouffleError
from souffle_py.frontend import import_onnx
from souffle_py.runtime import CompiledModel
from souffle_py.schedule.default import schedule_cpu
from souffle_py.ir.marks import member_of
from test_vertical import dags


def _compile_in_parts(proto, parts: int) -> CompiledModel:
    program = import_onnx(proto)
    stages = program.stages
    bounds = [_outside_recurrences(stages, b) for b in np.linspace(0, len(stages), parts + 1).astype(int)]
    return _merged(program, bounds)


def _merged(program, bounds) -> CompiledModel:
    """One merged kernel per [bounds[i], bounds[i + 1]) run of the program's stages."""
    stages, consumers = program.stages, program.consumers()
    kernels = [merged_kernel(program, stages[a:b], consumers, f"part{i}")
               for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])) if b > a]
    return build_compiled(program, kernels, backend_for("llvm"), schedule_cpu, 0.0)


def _outside_recurrences(stages, bound: int) -> int:
    """The first cut at or after `bound` that does not split a recurrence's step TEs."""
    while 0 < bound < len(stages) and member_of(stages[bound]) is not None \
            and member_of(stages[bound]) == member_of(stages[bound - 1]):
        bound += 1
    return bound


@pytest.mark.parametrize("name,overrides", [("bert", {}), ("lstm", {"spelling": "op"}),
                                            ("lstm", {"spelling": "unrolled"})])
@pytest.mark.parametrize("parts", [1, 3])
def test_merged_parts_equal_unfused(name, overrides, parts):
    proto = build_model(name, tiny=True, **overrides)
    merged = _compile_in_parts(proto, parts)
    assert merged.num_kernels == parts
    unfused = unfused_tvm(proto)
    feeds = unfused.random_feeds(seed=3)
    expected = unfused.run(feeds)
    for key, value in merged.run(feeds).items():
        np.testing.assert_allclose(value, expected[key], rtol=1e-5, atol=1e-6)


def test_a_kernel_cannot_hold_part_of_a_recurrence():
    program = import_onnx(build_model("lstm", tiny=True))
    stages = program.stages
    first = next(i for i, op in enumerate(stages) if member_of(op) is not None)
    with pytest.raises(SouffleError, match="only part of recurrence"):
        merged_kernel(program, stages[:first + 1], program.consumers(), "split")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dags(), st.data())
def test_random_programs_merged_at_random_cuts_equal_unfused(program, data):
    """Random small TE DAGs (tests/test_vertical.py), cut anywhere into merged kernels, default schedules."""
    n = len(program.stages)
    cuts = sorted(data.draw(st.sets(st.integers(1, max(n - 1, 1)), max_size=3)))
    merged = _merged(program, [0, *[c for c in cuts if c < n], n])
    unfused = build_compiled(program, unfused_kernels(program), backend_for("llvm"), schedule_cpu, 0.0)
    feeds = program.random_feeds(seed=5)
    expected = unfused.run(feeds)
    for key, value in merged.run(feeds).items():
        np.testing.assert_allclose(value, expected[key], rtol=1e-5, atol=1e-5)
