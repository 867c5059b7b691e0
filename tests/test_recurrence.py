"""Recurrences (the ONNX LSTM op): one time loop per layer inside one kernel, checked against ONNX Runtime."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from tvm import s_tir

import souffle_py
from models.registry import build_model
from souffle_py.backends.cpu import CpuBackend
from souffle_py.baselines import OnnxRuntimeModel, unfused_tvm
from souffle_py.codegen.merge import merged_kernel
from souffle_py.codegen.recurrence import close_back_edges, is_time_loop
from souffle_py.frontend import import_onnx
from souffle_py.partition import CacheResidentPolicy, partition
from souffle_py.schedule.default import schedule_cpu
from souffle_py.ir.analysis import analyze
from souffle_py.ir.marks import member_of, recurrences


def _check(proto, feeds=None, **options):
    compiled = souffle_py.optimize(proto, quiet=True, **options)
    feeds = feeds or compiled.random_feeds(seed=2)
    expected = OnnxRuntimeModel(proto, threads=1).run(feeds)
    for name, value in compiled.run(feeds).items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-4, atol=1e-5)
    return compiled


def test_stacked_lstm_is_one_kernel_with_a_time_loop_per_layer():
    proto = build_model("lstm", tiny=True, layers=3, steps=7, hidden=128)  # 4 x 128 gates: two GEMV tiles
    compiled = _check(proto)
    assert compiled.num_kernels == 1
    (kernel,) = compiled.kernels
    assert len(kernel.loops) == 3
    assert "time loops: 3" in compiled.describe()
    sch = s_tir.Schedule(schedule_cpu(kernel.func))
    time_loops = []
    for block in sch.get_child_blocks(sch.get_sblock("root")):
        for loop in sch.get_loops(block):
            if is_time_loop(sch, loop) and not any(sch.get(loop).same_as(seen) for seen in time_loops):
                time_loops.append(sch.get(loop))
    assert len(time_loops) == 3 and all(int(loop.kind) == 0 for loop in time_loops)  # serial
    # each runs as one parallel launch: the steps' loops are shared out and end at a barrier
    assert all("pragma_parallel_launch_point" in loop.annotations for loop in time_loops)


def test_a_recurrence_of_little_work_per_step_runs_its_steps_on_one_thread():
    """No step barrier where a second thread saves less than it costs (and where a preempted thread would
    stall every step); a model that small runs wholly on one thread."""
    compiled = _check(build_model("lstm", tiny=True, layers=2, steps=5))
    (kernel,) = compiled.kernels
    assert "pragma_parallel_launch_point" not in schedule_cpu(kernel.func).script()
    whole = CpuBackend.for_target("llvm").default_scheduler(compiled.kernels)(kernel.func).script()
    assert "T.parallel" not in whole


def test_unfused_reference_keeps_each_recurrence_in_one_kernel():
    proto = build_model("lstm", tiny=True, layers=2, steps=4)
    unfused = unfused_tvm(proto)
    feeds = unfused.random_feeds(seed=4)
    expected = OnnxRuntimeModel(proto, threads=1).run(feeds)
    for name, value in unfused.run(feeds).items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-4, atol=1e-5)
    assert sum(len(k.loops) for k in unfused.kernels) == 2


def _lstm_graph(steps=6, batch=2, inputs=4, hidden=8, constant_weights=True, initial_states=True, seed=0):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((1, 4 * hidden, inputs)) * 0.5).astype(np.float32)
    r = (rng.standard_normal((1, 4 * hidden, hidden)) * 0.3).astype(np.float32)
    b = (rng.standard_normal((1, 8 * hidden)) * 0.1).astype(np.float32)
    graph_inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [steps, batch, inputs])]
    initializers = [onnx.numpy_helper.from_array(r, "R"), onnx.numpy_helper.from_array(b, "B")]
    if constant_weights:
        initializers.append(onnx.numpy_helper.from_array(w, "W"))
    else:
        graph_inputs.append(helper.make_tensor_value_info("W", TensorProto.FLOAT, list(w.shape)))
    names = ["x", "W", "R", "B"]
    if initial_states:
        names += ["", "h0", "c0"]
        graph_inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, batch, hidden]) for n in ("h0", "c0")]
    node = helper.make_node("LSTM", names, ["Y", "Y_h", "Y_c"], hidden_size=hidden, name="lstm")
    outputs = [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [steps, 1, batch, hidden]),
               helper.make_tensor_value_info("Y_h", TensorProto.FLOAT, [1, batch, hidden]),
               helper.make_tensor_value_info("Y_c", TensorProto.FLOAT, [1, batch, hidden])]
    graph = helper.make_graph([node], "lstm", graph_inputs, outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    model.ir_version = 10
    onnx.checker.check_model(model)
    return model, w


@pytest.mark.parametrize("merge", [True, False])
def test_initial_states_batch_and_all_three_outputs(merge):
    proto, _ = _lstm_graph()
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((6, 2, 4)).astype(np.float32),
             "h0": rng.standard_normal((1, 2, 8)).astype(np.float32),
             "c0": rng.standard_normal((1, 2, 8)).astype(np.float32)}
    _check(proto, feeds, merge=merge)


def test_weights_given_at_run_time():
    proto, w = _lstm_graph(constant_weights=False, initial_states=False)
    feeds = {"x": np.random.default_rng(2).standard_normal((6, 2, 4)).astype(np.float32), "W": w}
    _check(proto, feeds)


def test_back_edges_are_closed_after_scheduling():
    program = import_onnx(build_model("lstm", tiny=True, layers=1, steps=3))
    kernel = merged_kernel(program, program.stages, program.consumers(), "all")
    (loop,) = kernel.loops
    states = {state for state, _ in loop.back_edges}
    assert states <= {p.name for p in kernel.func.params}  # scheduled as ordinary inputs
    closed = close_back_edges(schedule_cpu(kernel.func), kernel.loops)
    assert not states & {p.name for p in closed.params}
    assert len(closed.params) == len(kernel.args)


def test_partition_never_cuts_inside_a_recurrence():
    program = import_onnx(build_model("lstm", tiny=True, layers=2, steps=3))
    parts = partition(analyze(program), program.stages, CacheResidentPolicy(budget_bytes=1, max_stages=1))
    assert len(parts.subprograms) > 1  # the tiny budget cuts before every other compute-intensive TE
    for name, members in recurrences(program.stages).items():
        holders = [i for i, sub in enumerate(parts.subprograms) if any(member_of(op) == name for op in sub.ops)]
        assert len(holders) == 1 and sum(member_of(op) == name for op in parts.subprograms[holders[0]].ops) == 3
