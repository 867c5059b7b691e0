"""Horizontal transformation: independent same-kind TEs become one TE; readers read their slice through the
embedding maps. Checked by isl inside the pass and here by running the programs (float32, rtol 1e-5 /
atol 1e-6 against the untransformed program; rtol 1e-4 / atol 1e-5 against ONNX Runtime)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import te

import te_passes.horizontal as horizontal_module
from models.registry import build_model
from souffle_py.baselines import OnnxRuntimeModel
from souffle_py.cpu_target import using
from souffle_py.frontend import import_onnx
from souffle_py.ir.program import TEProgram
from souffle_py.ir.analysis import analyze, maps_equal
from souffle_py.ir.analysis.body import IF_THEN_ELSE
from te_passes.check import assert_same_outputs, run_program
from te_passes.horizontal import horizontal
from souffle_py.passes import conv_weights_blocked, transformed
from te_passes.vertical import vertical
from test_cpu_target import HASWELL, SPR


def figure3(weights_as_params: bool) -> TEProgram:
    """The paper's Figure 3: two GEMMs with a common reduction, outputs (4, 16) and (2, 16), each read by
    its own consumer."""
    rng = np.random.default_rng(0)
    values = {n: rng.standard_normal(s).astype("float32") for n, s in
              [("A1", (4, 8)), ("B1", (8, 16)), ("A2", (2, 8)), ("B2", (8, 16))]}
    holders = {n: te.placeholder(v.shape, name=n) for n, v in values.items()}
    A1, B1, A2, B2 = (holders[n] for n in ["A1", "B1", "A2", "B2"])

    def gemm(A, B, rows, name):
        rk = te.reduce_axis((0, 8), name="rk")
        return te.compute((rows, 16), lambda i, j: te.sum(A[i, rk] * B[rk, j], axis=[rk]), name=name)

    C1, C2 = gemm(A1, B1, 4, "C1"), gemm(A2, B2, 2, "C2")
    D1 = te.compute((4, 16), lambda i, j: C1[i, j] * 2.0, name="D1")
    D2 = te.compute((16, 2), lambda j, i: C2[i, j] + 1.0, name="D2")
    if weights_as_params:
        return TEProgram(inputs={}, params=values, param_tensors=holders, outputs={"D1": D1, "D2": D2})
    return TEProgram(inputs=holders, params={}, param_tensors={}, outputs={"D1": D1, "D2": D2})


def _calls(expr, op) -> int:
    found = []
    tvm_ffi.structural_walk(expr, [(tvm.ir.Call, lambda c: found.append(c.op.same_as(op)))])
    return sum(found)


def test_figure3_gemms_of_different_shapes_become_one_predicated_te():
    program = figure3(weights_as_params=False)
    new, log = horizontal(program)
    (group,) = log.groups
    assert group.members == ("C1", "C2") and group.layout == "concat axis 0" and group.predicated == 2
    combined = next(op for op in new.stages if op.name == group.name)
    assert [int(d) for d in combined.output(0).shape] == [6, 16]
    assert _calls(combined.body[0], IF_THEN_ELSE) == 2  # if_then_else(i < 4, A1[i, rk], A2[i - 4, rk]), same for B
    after = analyze(new)
    assert maps_equal(after.tes[group.name].access("A2").map,
                      f"{{ {group.name}[i, j] -> A2[i - 4, rk] : 4 <= i < 6 and 0 <= j < 16 and 0 <= rk < 8 }}")
    # the readers read their slice: no copy TE was added
    assert len(new.stages) == len(program.stages) - 1
    assert maps_equal(after.access("D2", group.name), f"{{ D2[j, i] -> {group.name}[i + 4, j] : "
                                                      "0 <= i < 2 and 0 <= j < 16 }")
    assert_same_outputs(program, new)


def test_figure3_with_weights_concatenates_the_row_operands():
    program = figure3(weights_as_params=True)
    new, log = horizontal(program)
    (group,) = log.groups
    assert group.stacked == ("A1_h2",) and group.predicated == 1  # A1/A2 -> one (6, 8) weight; B selected
    np.testing.assert_array_equal(new.params["A1_h2"], np.concatenate([program.params["A1"], program.params["A2"]]))
    assert "A1" not in new.params and "B1" in new.params
    assert_same_outputs(program, new)


def _gemm(a, w, name):
    rk = te.reduce_axis((0, int(a.shape[1])), name="rk")
    return te.compute((a.shape[0], w.shape[1]), lambda i, j: te.sum(a[i, rk] * w[rk, j], axis=[rk]), name=name)


def _plus_one(x, name):
    return te.compute(x.shape, lambda i, j: x[i, j] + 1.0, name=name)


def _gemms(shapes, shared_input: bool) -> TEProgram:
    """GEMMs out_b = A_b @ W_b of (rows, columns) `shapes` over K = 64, weights as parameters; one input A
    for all if `shared_input`."""
    rng = np.random.default_rng(1)
    inputs, params, holders, outputs = {}, {}, {}, {}
    for b, (rows, cols) in enumerate(shapes):
        a_name = "A" if shared_input else f"A{b}"
        if a_name not in inputs:
            inputs[a_name] = te.placeholder((rows, 64), name=a_name)
        params[f"W{b}"] = rng.standard_normal((64, cols)).astype("float32")
        holders[f"W{b}"] = te.placeholder((64, cols), name=f"W{b}")
        gemm = _gemm(inputs[a_name], holders[f"W{b}"], f"C{b}")
        outputs[f"D{b}"] = _plus_one(gemm, f"D{b}")
    return TEProgram(inputs=inputs, params=params, param_tensors=holders, outputs=outputs)


def test_large_gemms_of_different_shapes_that_would_need_predicates_stay_apart():
    """Above PREDICATED_MACS, members of different shapes and their own inputs are not combined through
    predicates (each multiply-add would choose its operands: Funnel's twelve position projections ran as one
    scalar reduction); the choice is logged as kept apart."""
    program = _gemms([(64, 64), (32, 64)], shared_input=False)
    assert horizontal_module._multiply_adds(program.stages[:2]) > horizontal_module.PREDICATED_MACS
    new, log = horizontal(program)
    assert not log.groups and not log.refused
    assert any("split into 2 parts" in line for line in log.kept_apart)
    assert_same_outputs(program, new)


def test_gemms_of_different_shapes_over_one_input_combine_without_predicates():
    """Q and K projections of different widths (grouped-query attention) over one input: one GEMM over the
    concatenated weights, however large."""
    program = _gemms([(64, 128), (64, 64)], shared_input=True)
    new, log = horizontal(program)
    (group,) = (g for g in log.groups if g.members == ("C0", "C1"))
    assert group.predicated == 0 and group.shared == ("A",) and len(group.stacked) == 1
    assert_same_outputs(program, new)


def test_dependent_tes_of_the_same_kind_are_not_combined():
    A = te.placeholder((8,), name="A")
    B = te.compute((8,), lambda i: A[i] * 2.0, name="B")
    C = te.compute((8,), lambda i: B[i] * 2.0, name="C")
    D = te.compute((8,), lambda i: C[i] + B[i], name="D")
    program = TEProgram(inputs={"A": A}, params={}, param_tensors={}, outputs={"D": D})
    new, log = horizontal(program)
    assert not log.groups and len(new.stages) == 3


def test_isl_check_refuses_a_wrong_layout(monkeypatch):
    real = horizontal_module.Layout.local

    def shifted(self, k, op):  # a broken layout: members read one row off
        mapping = real(self, k, op)
        return {h: v + 1 if n == 0 else v for n, (h, v) in enumerate(mapping.items())}

    monkeypatch.setattr(horizontal_module.Layout, "local", shifted)
    program = figure3(weights_as_params=False)
    new, log = horizontal(program)
    assert not log.groups and len(log.refused) == 1 and "C1, C2" in log.refused[0]
    assert_same_outputs(program, new)


def test_bert_qkv_gemms_share_their_input_and_weights_concatenate():
    program = import_onnx(build_model("bert", tiny=True))
    new, log = horizontal(*vertical(program)[:1])
    qkv = [g for g in log.groups if g.name.endswith("matmul_h3")]
    assert len(qkv) == 2
    for layer, group in enumerate(qkv):
        p = f"layer{layer}_attn_"
        assert group.members == (f"{p}k_matmul", f"{p}q_matmul", f"{p}v_matmul")
        assert group.layout == "concat axis 2" and group.predicated == 0 and len(group.shared) == 1
        (weight,) = group.stacked
        np.testing.assert_array_equal(new.params[weight], np.concatenate(
            [program.params[f"{p}{x}_w"] for x in "kqv"], axis=1))  # one (64, 192) GEMM operand
        assert not any(f"{p}{x}_w" in new.params for x in "qkv")
    biases = [g for g in log.groups if g.name.endswith("bias_h3")]  # the epilogues combine too, no predicates
    assert len(biases) == 2 and all(g.predicated == 0 for g in biases)
    assert log.tes_before == 48 and log.tes_after == 40 and not log.refused


def test_mmoe_experts_and_gates_read_the_input_once():
    proto = build_model("mmoe", tiny=True)
    program = import_onnx(proto)
    new, log = horizontal(*vertical(program)[:1])
    first = log.groups[0]
    assert set(first.members) == {"expert0_fc0", "expert1_fc0", "expert2_fc0", "task0_gate", "task1_gate"}
    assert first.shared == ("input",) and first.predicated == 0  # one GEMV over the concatenated weights
    assert sum(1 for op in new.stages for t in op.input_tensors if t.op.name == "input") == 1
    feeds = program.random_feeds(seed=1)
    expected = OnnxRuntimeModel(proto).run(feeds)
    for key, value in run_program(new, feeds).items():
        np.testing.assert_allclose(value, expected[key], rtol=1e-4, atol=1e-5)


def _wavefront(te_name: str) -> int:
    layer, step = re.match(r"layer(\d+)_t(\d+)_", te_name).groups()
    return int(layer) + int(step)


@pytest.mark.parametrize("layers,steps", [(2, 5), (3, 6)])
def test_unrolled_lstm_cells_combine_per_wavefront(layers, steps):
    proto = build_model("lstm", tiny=True, spelling="unrolled", layers=layers, steps=steps, hidden=8)
    program = import_onnx(proto)
    new, log = horizontal(*vertical(program)[:1])
    assert not log.refused
    by_front: dict[int, list] = {}
    for group in log.groups:
        fronts = {_wavefront(m) for m in group.members}
        if not all(m.startswith("layer0_") and m.endswith("x_matmul") for m in group.members):
            assert len(fronts) == 1, group.members  # only layer 0's input GEMVs span the steps (one GEMM)
            by_front.setdefault(fronts.pop(), []).append(group)
    # wavefronts whose cells and their predecessors are all interior cells (step 0 and a layer's last step differ)
    interior = [w for w in range(layers + steps) if all(2 <= w - l <= steps - 2 for l in range(layers))]
    assert interior
    stage_names = {op.name for op in new.stages}
    for w in interior:
        # the cell states of an interior wavefront are one TE, its hidden states one TE; its recurrent and
        # input GEMVs at most two, with no predicate in a multiply-add (GEMVs reading different inputs
        # through predicates are split by input: on a CPU a predicated operand costs a branch per iteration)
        cells = [(l, w - l) for l in range(layers)]
        groups = by_front[w]
        for suffix in ("c_add", "h"):
            assert any({m for m in g.members} == {f"layer{l}_t{t}_{suffix}" for l, t in cells} for g in groups)
        gemvs = {f"layer{l}_t{t}_h_matmul" for l, t in cells} | {f"layer{l}_t{t}_x_matmul" for l, t in cells if l}
        gemv_groups = [g for g in groups if set(g.members) <= gemvs]
        singles = gemvs - {m for g in gemv_groups for m in g.members}
        assert singles <= stage_names and len(gemv_groups) + len(singles) <= 2
        assert all(g.predicated == 0 for g in gemv_groups)
    feeds = program.random_feeds(seed=4)
    expected = OnnxRuntimeModel(proto).run(feeds)
    for key, value in run_program(new, feeds).items():
        np.testing.assert_allclose(value, expected[key], rtol=1e-4, atol=1e-5)


def _inception_branches(filters) -> "onnx.ModelProto":
    """GoogLeNet's inception module head: 1x1 convs of `filters` output channels reading one input."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(0)
    inits, nodes, outputs = [], [], []
    for b, f in enumerate(filters):
        inits.append(numpy_helper.from_array(rng.standard_normal((f, 32, 1, 1)).astype(np.float32), f"w{b}"))
        nodes.append(helper.make_node("Conv", ["x", f"w{b}"], [f"c{b}"], kernel_shape=[1, 1]))
        nodes.append(helper.make_node("Relu", [f"c{b}"], [f"y{b}"]))
        outputs.append(helper.make_tensor_value_info(f"y{b}", TensorProto.FLOAT, [1, f, 7, 7]))
    graph = helper.make_graph(nodes, "inception", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32, 7, 7])],
                              outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("target", [HASWELL, SPR])
@pytest.mark.parametrize("filters", [(64, 96, 16), (48, 40, 24), (64, 64, 64)])
def test_convs_of_one_input_concatenate_their_blocked_weights(filters, target):
    """Weights blocked by output channel (frontend: [F/B, C, 1, 1, B], B a vector or half of one: 16 or 8
    with AVX-512, 8 or 4 with AVX2) concatenate into one re-blocked weight: one conv with no predicate per
    multiply-add. Equal convs too (Inception-v3's three 768 -> 192), not stacked on a member axis, which kept
    their 16-channel weight blocks."""
    proto = _inception_branches(filters)
    with using(target) as cpu:
        program = conv_weights_blocked(import_onnx(proto))
        new, log = horizontal(program)
    (group,) = [g for g in log.groups if len(g.members) == len(filters)]
    assert group.predicated == 0 and len(group.stacked) == 1
    total = sum(filters)
    block = cpu.lanes if total % cpu.lanes == 0 else cpu.lanes // 2
    assert new.params[group.stacked[0]].shape == (total // block, 32, 1, 1, block)
    feeds = program.random_feeds(seed=1)
    expected = OnnxRuntimeModel(proto).run(feeds)
    for key, value in run_program(new, feeds).items():
        np.testing.assert_allclose(value, expected[key], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("filters", [32, 28])  # weights in 16-filter blocks; one unblocked block of 28
def test_equal_convs_over_different_input_slices_stack_rather_than_concatenate(filters):
    """MixNet's split-channel pointwise convs, Res2Net's 28-filter convs: equal convs, each over its own
    slice of one input. Concatenated along the output channels, the combined conv's input would depend on
    its output channel, a gather per vector lane (MixNet-s 6.9 -> 10.6 ms; Res2Net-50-14w-8s's first
    stage-2 convs at 6 GFLOP/s); they stack on a member axis instead."""
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(np.array([16, 16], np.int64), "split")]
    nodes = [helper.make_node("Split", ["x", "split"], ["s0", "s1"], axis=1)]
    for b in range(2):
        inits.append(numpy_helper.from_array(rng.standard_normal((filters, 16, 1, 1)).astype(np.float32), f"w{b}"))
        nodes.append(helper.make_node("Conv", [f"s{b}", f"w{b}"], [f"y{b}"], kernel_shape=[1, 1]))
    nodes.append(helper.make_node("Concat", ["y0", "y1"], ["y"], axis=1))
    nodes.append(helper.make_node("Relu", ["y"], ["out"]))
    graph = helper.make_graph(nodes, "split_convs", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32, 7, 7])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 2 * filters, 7, 7])],
                              inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    program = import_onnx(proto)
    new, records = transformed(program)  # vertical composes the slices into the convs
    groups = [g for g in records[-1].log.groups if len(g.members) == 2]
    # stacked: on a new axis, or along the unit batch axis, which concatenates like one
    assert groups and all(g.layout in ("new axis 0", "concat axis 0") for g in groups), [
        (g.members, g.layout) for g in groups]
    feeds = program.random_feeds(seed=1)
    expected = OnnxRuntimeModel(proto).run(feeds)
    for key, value in run_program(new, feeds).items():
        np.testing.assert_allclose(value, expected[key], rtol=1e-4, atol=1e-4)


def test_convs_that_would_choose_their_input_per_multiply_add_stay_apart():
    """HRNet's fuse layers: strided 3x3 convs of 32, 16 and 16 filters, each over its own pad of one map.
    Combined, the conv chose input and weight by a predicate per multiply-add and ran as a scalar reduction
    (3.7 GFLOP/s, HRNet-w18-small 1.47x ONNX Runtime); they stay apart."""
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(0)
    inits, nodes, outputs = [], [], []
    for b, filters in enumerate((32, 16, 16)):
        inits.append(numpy_helper.from_array(rng.standard_normal((filters, 16, 3, 3)).astype(np.float32), f"w{b}"))
        nodes.append(helper.make_node("Conv", ["x", f"w{b}"], [f"c{b}"], kernel_shape=[3, 3], strides=[2, 2],
                                      pads=[1, 1, 1, 1]))
        nodes.append(helper.make_node("Relu", [f"c{b}"], [f"y{b}"]))
        outputs.append(helper.make_tensor_value_info(f"y{b}", TensorProto.FLOAT, [1, filters, 6, 6]))
    graph = helper.make_graph(nodes, "fuse_layers", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 12, 12])],
                              outputs, inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    program = import_onnx(proto)
    new, records = transformed(program)
    log = records[-1].log
    assert not any(g.predicated and any(m.endswith("_conv") for m in g.members) for g in log.groups)
    assert any("per multiply-add" in r for r in log.kept_apart) and not log.refused  # a choice, not a warning
    feeds = program.random_feeds(seed=1)
    expected = OnnxRuntimeModel(proto).run(feeds)
    for key, value in run_program(new, feeds).items():
        np.testing.assert_allclose(value, expected[key], rtol=1e-4, atol=1e-4)
