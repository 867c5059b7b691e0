"""Vertical transformation: chains of one-relies-on-one TEs collapse into one TE, checked by isl and by
running the programs (float32, rtol 1e-5 / atol 1e-6 against the untransformed program; rtol 1e-4 /
atol 1e-5 against ONNX Runtime)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tvm import te, tirx

import te_passes.vertical as vertical_module
from models.registry import build_model
from souffle_py.baselines import OnnxRuntimeModel
from souffle_py.frontend import import_onnx
from souffle_py.ir.program import TEProgram
from souffle_py.ir.analysis import analyze, maps_equal
from te_passes.check import assert_same_outputs, run_program
from souffle_py.ir.graph import compute_ops, rebuild, tensor_key
from te_passes.vertical import vertical


def program_of(inputs, outputs, params=None) -> TEProgram:
    params = params or {}
    tensors = {name: te.placeholder(v.shape, str(v.dtype), name=name) for name, v in params.items()}
    return TEProgram(inputs={t.op.name: t for t in inputs}, params=params, param_tensors=tensors,
                     outputs={t.op.name: t for t in outputs})


def figure4():
    """The paper's Figure 4: relu -> strided slice -> permute."""
    A = te.placeholder((4, 8), name="A")
    B = te.compute((4, 8), lambda i, j: tirx.if_then_else(A[i, j] > 0, A[i, j], tirx.const(0.0, "float32")), name="B")
    C = te.compute((2, 4), lambda i, j: B[2 * i, j], name="C")
    D = te.compute((4, 2), lambda i, j: C[j, i], name="D")
    return program_of([A], [D])


def test_figure4_chain_becomes_one_te():
    program = figure4()
    new, log = vertical(program)
    assert [op.name for op in new.stages] == ["D"]
    assert log.tes_before == 3 and log.tes_after == 1 and log.chains == {"D": ("C", "B")}
    access = analyze(new).tes["D"].access("A")
    # D[i, j] = C[j, i] = B[2j, i]: the paper's matrix [[0, 1], [2, 0]] (its listing prints A[j, 2*i])
    assert maps_equal(access.map, "{ D[i, j] -> A[2j, i] : 0 <= i < 4 and 0 <= j < 2 }")
    assert access.M.tolist() == [[0, 1], [2, 0]] and access.c.tolist() == [0, 0]
    assert maps_equal(access.map, analyze(program).chain_map(["D", "C", "B", "A"]))
    assert_same_outputs(program, new)


def test_isl_check_refuses_a_wrong_composition(monkeypatch):
    """A composition whose maps disagree with the chain is refused and the producer stays materialized."""
    def transposed(composite):  # a broken inliner: reads the producer at swapped indices
        right = real(composite)
        return lambda indices: right(indices[::-1]) if len(indices) == 2 else right(indices)

    real = vertical_module._inline
    monkeypatch.setattr(vertical_module, "_inline", transposed)
    A = te.placeholder((4, 4), name="A")
    B = te.compute((4, 4), lambda i, j: A[i, j] * 2.0, name="B")
    C = te.compute((4, 4), lambda i, j: B[i, j] + A[j, i], name="C")
    program = program_of([A], [C])
    new, log = vertical(program)
    assert len(log.isl_refusals) == 1 and "B -> C" in log.isl_refusals[0]
    assert [op.name for op in new.stages] == ["B", "C"]
    assert_same_outputs(program, new)


def test_expensive_op_with_two_readers_stays_and_cheap_one_is_inlined():
    A = te.placeholder((8, 8), name="A")
    E = te.compute((8, 8), lambda i, j: te.exp(A[i, j]), name="E")  # an intrinsic: recomputing costs 8
    S = te.compute((8, 8), lambda i, j: A[i, j] + 1.0, name="S")  # one add
    X = te.compute((8, 8), lambda i, j: E[i, j] * S[i, j], name="X")
    Y = te.compute((8, 8), lambda i, j: E[i, j] - S[i, j], name="Y")
    Z = te.compute((8, 8), lambda i, j: X[i, j] + Y[j, i], name="Z")
    program = program_of([A], [Z])
    new, log = vertical(program)
    assert sorted(op.name for op in new.stages) == ["E", "Z"]  # S recomputed in X and Y, X and Y inlined
    assert_same_outputs(program, new)


def test_cheap_op_is_not_recomputed_per_gemm_iteration():
    """A bias add feeding a GEMM's operand would be recomputed N times: it stays; a transpose is folded."""
    A = te.placeholder((16, 8), name="A")
    W = te.placeholder((16, 16), name="W")
    biased = te.compute((16, 8), lambda i, k: A[i, k] + 1.0, name="biased")
    flipped = te.compute((8, 16), lambda k, i: biased[i, k], name="flipped")
    k = te.reduce_axis((0, 8), name="k")
    out = te.compute((16, 16), lambda i, j: te.sum(flipped[k, i] * W[j, k // 2], axis=k), name="out")
    program = program_of([A, W], [out])
    new, log = vertical(program)
    assert [op.name for op in new.stages] == ["biased", "out"]
    assert log.chains == {"out": ("flipped",)} and log.kept == {"recompute over budget": 1, "program output": 1}
    assert_same_outputs(program, new)


# -- the models --------------------------------------------------------------------------------------------

def test_bert_attention_reshapes_fold_into_batch_matmuls():
    proto = build_model("bert", tiny=True)
    program = import_onnx(proto)
    before = analyze(program)
    new, log = vertical(program, before)
    after = analyze(new)
    names = {op.name for op in new.stages}
    assert not any(n.endswith(("_reshape", "_transpose")) for n in names)
    for layer in range(2):  # the scores GEMM reads the Q/K bias TEs through the composed reshape+transpose
        p = f"layer{layer}_attn_"
        for x in "qk":
            chain = before.chain_map([f"{p}scores", f"{p}{x}_transpose", f"{p}{x}_reshape", f"{p}{x}_bias"])
            assert maps_equal(after.tes[f"{p}scores"].access(f"{p}{x}_bias").map, chain)
        # the GELU epilogue: one TE reading the fc1 GEMM one-to-one, itself read by the fc2 GEMM
        gelu = after.tes[f"layer{layer}_ffn_gelu_mul"]
        assert gelu.access(f"layer{layer}_ffn_fc1_matmul").kind == "one-to-one"
        assert set(log.chains[f"layer{layer}_ffn_gelu_mul"]) >= {f"layer{layer}_ffn_fc1_bias",
                                                                  f"layer{layer}_ffn_gelu_erf"}
        assert after.tensors[f"layer{layer}_ffn_gelu_mul"].readers == (f"layer{layer}_ffn_fc2_matmul",)
    assert log.tes_before == 102 and log.tes_after == 48 and not log.isl_refusals


@pytest.mark.parametrize("name,overrides", [("bert", {"layernorm": "op"}), ("lstm", {"spelling": "op"}),
                                            ("lstm", {"spelling": "unrolled"})])
def test_models_match_onnx_runtime(name, overrides):
    proto = build_model(name, tiny=True, **overrides)
    program = import_onnx(proto)
    new, log = vertical(program)
    assert log.tes_after < log.tes_before and not log.isl_refusals
    feeds = program.random_feeds(seed=2)
    expected = OnnxRuntimeModel(proto).run(feeds)
    for key, value in run_program(new, feeds).items():
        np.testing.assert_allclose(value, expected[key], rtol=1e-4, atol=1e-5)


# -- property: random chains and DAGs of data movement and elementwise ops feeding a reduction -----------

def _unary(draw, x):
    kind = draw(st.sampled_from(["affine", "relu", "exp", "neg"]))
    f = {"affine": lambda v: v * 1.5 + 0.25, "relu": lambda v: te.max(v, tirx.const(0.0, "float32")),
         "exp": lambda v: te.exp(v * 0.5), "neg": lambda v: -v}[kind]
    return te.compute(x.shape, lambda *i: f(x(*i)), name=f"{kind}")


def _binary(draw, x, tensors):
    same = [t for t in tensors if _shape(t) == _shape(x)]
    y = draw(st.sampled_from(same))
    return te.compute(x.shape, lambda *i: x(*i) * y(*i) + x(*i), name="mul_add")


def _broadcast(draw, x):
    if len(x.shape) >= 4:
        return None
    axis = draw(st.integers(0, len(x.shape)))
    shape = _shape(x)[:axis] + (2,) + _shape(x)[axis:]
    return te.compute(shape, lambda *i: x(*(i[:axis] + i[axis + 1:])), name="broadcast")


def _reshape(draw, x):
    shape = _shape(x)
    merges = [a for a in range(len(shape) - 1)]
    splits = [a for a in range(len(shape)) if shape[a] % 2 == 0 and shape[a] > 2 and len(shape) < 4]
    options = [("merge", a) for a in merges] + [("split", a) for a in splits]
    if not options:
        return None
    kind, a = draw(st.sampled_from(options))
    if kind == "merge":
        new = shape[:a] + (shape[a] * shape[a + 1],) + shape[a + 2:]
        return te.compute(new, lambda *i: x(*(i[:a] + (i[a] // shape[a + 1], i[a] % shape[a + 1]) + i[a + 1:])),
                          name="reshape")
    new = shape[:a] + (shape[a] // 2, 2) + shape[a + 1:]
    return te.compute(new, lambda *i: x(*(i[:a] + (i[a] * 2 + i[a + 1],) + i[a + 2:])), name="reshape")


def _transpose(draw, x):
    perm = draw(st.permutations(range(len(x.shape))))
    shape = tuple(_shape(x)[p] for p in perm)
    inverse = [perm.index(k) for k in range(len(perm))]
    return te.compute(shape, lambda *i: x(*(i[inverse[k]] for k in range(len(perm)))), name="transpose")


def _slice(draw, x):
    shape = _shape(x)
    axes = [a for a in range(len(shape)) if shape[a] >= 2]
    if not axes:
        return None
    a = draw(st.sampled_from(axes))
    if draw(st.booleans()):  # strided
        return te.compute(shape[:a] + (shape[a] // 2,) + shape[a + 1:],
                          lambda *i: x(*(i[:a] + (i[a] * 2 + 1,) + i[a + 1:])), name="strided")
    start = draw(st.integers(0, shape[a] - 1))
    size = draw(st.integers(1, shape[a] - start))
    return te.compute(shape[:a] + (size,) + shape[a + 1:], lambda *i: x(*(i[:a] + (i[a] + start,) + i[a + 1:])),
                      name="slice")


def _shape(t):
    return tuple(int(d) for d in t.shape)


@st.composite
def dags(draw):
    """A random DAG: each op reads one of the last three tensors (a binary op also any earlier tensor of the
    same shape), so intermediates get several readers; two reductions read the last tensor and a random one."""
    x = te.placeholder(tuple(draw(st.lists(st.sampled_from([2, 3, 4]), min_size=1, max_size=3))), name="x")
    tensors = [x]
    builders = {"unary": _unary, "broadcast": _broadcast, "reshape": _reshape, "transpose": _transpose,
                "slice": _slice}
    for _ in range(draw(st.integers(1, 6))):
        source = draw(st.sampled_from(tensors[-3:]))
        kind = draw(st.sampled_from(["unary", "binary", "broadcast", "reshape", "transpose", "slice"]))
        made = _binary(draw, source, tensors) if kind == "binary" else builders[kind](draw, source)
        if made is not None:
            tensors.append(made)
    return _renamed(x, [_row_sum(tensors[-1]), _row_sum(draw(st.sampled_from(tensors)))])


def _row_sum(t):
    shape = _shape(t)
    k = te.reduce_axis((0, shape[-1]), name="k")
    return te.compute(shape[:-1] + (1,), lambda *i: te.sum(t(*(i[:-1] + (k,))) * 2.0, axis=k), name="sum")


def _renamed(x, outputs) -> TEProgram:
    """The program with TEs renamed t0, t1, ... (the runtime names buffers after TEs)."""
    new_of = {}
    for n, op in enumerate(compute_ops(outputs)):
        new = rebuild(op, new_of, name=f"t{n}_{op.name}")
        new_of[tensor_key(op.output(0))] = new.output(0)
    return program_of([x], [new_of[tensor_key(t)] for t in outputs])


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dags())
def test_random_programs_keep_their_values(program):
    new, log = vertical(program)
    assert not log.isl_refusals and log.tes_after <= log.tes_before
    assert_same_outputs(program, new)
