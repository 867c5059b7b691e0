"""schedule/threads.py and the recurrence parts of the default schedule: a recurrence's step as one
parallel region with as few barriers as its data allows, its time-uniform conditions vectorized."""

import re

import numpy as np
import pytest
import tvm
from tvm import te

import souffle_py
from models.registry import build_model
from souffle_py.baselines import OnnxRuntimeModel
from souffle_py.cpu_features import host_features
from souffle_py.cpu_target import using
from souffle_py.schedule.blocks import has_condition
from souffle_py.schedule.blocks import vector_lanes
from souffle_py.schedule.default import schedule_cpu
from tests.test_cpu_target import HASWELL, ZNVER4

VECTOR = vector_lanes()  # the host's: what a test outside cpu_target.using compiles for


def _lstm(**config):
    proto = build_model("lstm", tiny=True, **config)
    compiled = souffle_py.optimize(proto, quiet=True)
    feeds = compiled.random_feeds(seed=4)
    expected = OnnxRuntimeModel(proto, threads=1).run(feeds)
    for name, value in compiled.run(feeds).items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-4, atol=1e-5)
    return compiled


def test_an_lstm_step_meets_at_one_barrier():
    """Each thread computes all four gates of its own group of hidden units (the projection stored by
    groups, te_passes/gate_projections.py) and then their cell and hidden states (the cell state read only
    there, at the same point), all in one parallel loop: one barrier per step, at its end, instead of
    three. 256 hidden units: enough work per step for a parallel region."""
    compiled = _lstm(layers=2, steps=5, hidden=256, input=256)
    (kernel,) = compiled.kernels
    text = schedule_cpu(kernel.func).script()
    assert text.count("pragma_parallel_launch_point") == 2
    assert text.count("pragma_parallel_barrier_when_finish") == 2
    step = text[text.index("pragma_parallel_launch_point"):]
    step = step[:step.index("\n    for ")]  # the first time loop's body, up to the next top-level loop
    # the one parallel loop holds the gate projection's update and both elementwise blocks, each vectorized
    # (the state's "t == 0" is the same for every lane)
    assert len(re.findall(r"in T\.parallel", step)) == 1
    assert len(re.findall(r'T\.sblock\("s\d+(_update)?"\)', step)) >= 3
    assert step.count("T.vectorized(") >= 3



@pytest.mark.parametrize("target,groups", [(HASWELL, 8), (ZNVER4, 2)])
def test_a_bidirectional_lstm_step_meets_at_one_barrier(target, groups):
    """A bidirectional node's direction axis is shared out with the unit groups: each thread computes the
    gates of its groups of either direction and their cell updates in the same iteration, one parallel
    loop and one barrier per step, as for one direction. 128 units: groups of 16 (4 gates fill AVX2's
    64-lane GEMV tile) or of 64 (AVX-512's 256 lanes). Values where this CPU runs the target's code."""
    proto = build_model("bilstm", tiny=True, layers=2, steps=5, hidden=128, input=64)
    compiled = souffle_py.optimize(proto, target=target, quiet=True)
    (kernel,) = compiled.kernels
    with using(target):
        text = schedule_cpu(kernel.func).script()
    assert text.count("pragma_parallel_launch_point") == 2
    assert text.count("pragma_parallel_barrier_when_finish") == 2
    step = text[text.index("pragma_parallel_launch_point"):]
    step = step[:step.index("\n    for ")]
    assert re.findall(r"in T\.parallel\((\d+)", step) == [str(2 * groups)]  # 2 directions x the groups
    missing = sorted(set(compiled.plan.cpu_features) - (host_features() or set()))
    if missing:
        pytest.skip(f"the values: this CPU lacks {', '.join(missing)}")
    feeds = compiled.random_feeds(seed=4)
    expected = OnnxRuntimeModel(proto, threads=1).run(feeds)
    for name, value in compiled.run(feeds).items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-4, atol=1e-5)


def test_gate_groups_fit_the_register_tile():
    from souffle_py.schedule.budgets import gemv_tile_lanes
    from souffle_py.schedule.gates import group_units

    assert group_units(256, 4) * 4 <= gemv_tile_lanes() and 256 % group_units(256, 4) == 0
    assert group_units(256, 4) % VECTOR == 0
    assert group_units(VECTOR // 2, 4) == 0  # fewer units than a vector: no groups, the default schedule


def test_conditions_off_the_vector_axis_do_not_block_vectors():
    t, j = tvm.tirx.Var("t", "int32"), tvm.tirx.Var("j", "int32")
    x = te.placeholder((4, 32), name="x")
    first_step = tvm.tirx.if_then_else(t == 0, tvm.tirx.const(0.0, "float32"), x[t, j])
    by_column = tvm.tirx.if_then_else(j < 16, tvm.tirx.const(0.0, "float32"), x[t, j])
    assert not has_condition(first_step, uniform=[t])
    assert has_condition(by_column, uniform=[t])
    assert has_condition(first_step)  # nothing known to be uniform: conservative


def test_a_bidirectional_input_projection_is_one_gemm_per_direction():
    """x[T, B, K] @ W[D, K, N] -> [T, D, B, N] (a bidirectional recurrence's input projection): the
    direction loop moved outside the steps, so each direction is one GEMM of T * B rows in register tiles
    of several rows, not T GEMVs that each read all of W[d]; the same values."""
    steps, dirs, batch, size, width = 20, 2, 1, 32, 64
    x = te.placeholder((steps, batch, size), name="x")
    w = te.placeholder((dirs, size, width), name="w")
    k = te.reduce_axis((0, size), name="k")
    y = te.compute((steps, dirs, batch, width), lambda t, d, b, n: te.sum(x[t, b, k] * w[d, k, n], axis=k), name="y")
    func = schedule_cpu(te.create_prim_func([x, w, y]))
    rows = [int(n) for n in re.findall(r"in T\.unroll\((\d+)\)", func.script())]
    assert rows and max(rows) > 1  # 20 rows: 5 x 64 tiles (before: 1 x 64, one step at a time)
    rng = np.random.default_rng(0)
    xs, ws = rng.standard_normal((steps, batch, size), "float32"), rng.standard_normal((dirs, size, width), "float32")
    out = tvm.runtime.tensor(np.zeros((steps, dirs, batch, width), "float32"))
    tvm.compile(func, "llvm")(tvm.runtime.tensor(xs), tvm.runtime.tensor(ws), out)
    np.testing.assert_allclose(out.numpy(), np.einsum("tbk,dkn->tdbn", xs, ws), rtol=1e-4, atol=1e-4)
