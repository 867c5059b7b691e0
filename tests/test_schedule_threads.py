"""schedule/threads.py and the recurrence parts of the default schedule: a recurrence's step as one
parallel region with as few barriers as its data allows, its time-uniform conditions vectorized."""

import re

import numpy as np
import tvm
from tvm import te

import souffle_py
from models.registry import build_model
from souffle_py.baselines import OnnxRuntimeModel
from souffle_py.schedule.blocks import has_condition
from souffle_py.schedule.default import VECTOR, schedule_cpu


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


def test_gate_groups_fit_the_register_tile():
    from souffle_py.schedule.gates import GATE_TILE_LANES, group_units

    assert group_units(256, 4) * 4 <= GATE_TILE_LANES and 256 % group_units(256, 4) == 0
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
