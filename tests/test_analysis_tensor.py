"""Tensor-level analysis: work and traffic counts, CI/MI classification, live ranges, spatial and temporal reuse."""

from __future__ import annotations

import numpy as np
import pytest
from tvm import te, tirx

from souffle_py.ir.program import TEProgram
from souffle_py.ir.analysis import CI_THRESHOLD, analyze, maps_equal


def analysis_of(*outputs, params=()):
    params = {p.op.name: p for p in params}
    values = {n: np.zeros([int(d) for d in p.shape], "float32") for n, p in params.items()}
    program = TEProgram(inputs={}, params=values, param_tensors=params,
                        outputs={f"out{i}": t for i, t in enumerate(outputs)})
    return analyze(program)


def matmul(a, b, name):
    k = te.reduce_axis((0, int(a.shape[-1])), name="k")
    return te.compute((int(a.shape[0]), int(b.shape[1])), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k), name=name)


def test_gemm_counts_and_class():
    M, N, K = 32, 48, 64
    A, B = te.placeholder((M, K), name="A"), te.placeholder((K, N), name="B")
    gemm = analysis_of(matmul(A, B, "C")).tes["C"]
    assert gemm.points == M * N * K
    assert gemm.flops == 2 * M * N * K  # a multiply in the source, an add in the combiner
    assert gemm.loads == 2 * M * N * K and gemm.stores == M * N
    assert gemm.traffic_bytes == 4 * (M * K + K * N + M * N)
    assert gemm.intensity == pytest.approx(gemm.flops / gemm.traffic_bytes)
    assert gemm.contraction and gemm.klass == "CI"
    assert (gemm.shape, gemm.dtype, gemm.bytes) == ((M, N), "float32", 4 * M * N)


def test_batch_one_gemv_is_ci_by_contraction_though_memory_bound():
    h, R = te.placeholder((1, 256), name="h"), te.placeholder((256, 1024), name="R")
    gemv = analysis_of(matmul(h, R, "h_proj")).tes["h_proj"]
    assert gemv.intensity < 1 and gemv.contraction and gemv.klass == "CI"


def test_elementwise_and_data_movement_are_mi():
    X = te.placeholder((64, 64), name="X")
    relu = te.compute((64, 64), lambda i, j: tirx.max(X[i, j], tirx.const(0.0, "float32")), name="relu")
    transpose = te.compute((64, 64), lambda i, j: relu[j, i], name="transpose")
    analysis = analysis_of(transpose)
    assert analysis.tes["relu"].flops == 64 * 64 and analysis.tes["relu"].klass == "MI"
    # Index arithmetic is address computation, not work on elements.
    assert analysis.tes["transpose"].flops == 0 and analysis.tes["transpose"].loads == 64 * 64
    assert analysis.tes["transpose"].traffic_bytes == 2 * 64 * 64 * 4


def test_reductions_without_reuse_are_mi():
    X, Y = te.placeholder((16, 64), name="X"), te.placeholder((16, 64), name="Y")
    mean = te.placeholder((16,), name="mean")
    k1, k2, k3 = (te.reduce_axis((0, 64), name=f"k{n}") for n in range(3))
    total = te.compute((16,), lambda i: te.sum(X[i, k1], axis=k1), name="total")
    # LayerNorm's variance reads x twice at one index: one operand, not a contraction.
    var = te.compute((16,), lambda i: te.sum((X[i, k2] - mean[i]) * (X[i, k2] - mean[i]), axis=k2), name="var")
    # Two operands over the reduction but no element feeds two outputs: no reuse.
    mse = te.compute((16,), lambda i: te.sum((X[i, k3] - Y[i, k3]) * (X[i, k3] - Y[i, k3]), axis=k3), name="mse")
    analysis = analysis_of(total, var, mse)
    assert analysis.tes["var"].flops == 16 * 64 * 4  # sub, sub, mul, and the combiner's add
    for name in ("total", "var", "mse"):
        assert not analysis.tes[name].contraction and analysis.tes[name].klass == "MI", name


def test_arithmetic_intensity_threshold():
    X = te.placeholder((1024,), name="X")

    def chain(ops, name):
        def body(i):
            v = X[i]
            for _ in range(ops):
                v = tirx.exp(v)
            return v
        return te.compute((1024,), body, name=name)

    # 8 bytes move per element (4 read, 4 written): ops / 8 flops per byte.
    light, heavy = int(CI_THRESHOLD * 8) - 8, int(CI_THRESHOLD * 8) + 8
    analysis = analysis_of(chain(light, "light"), chain(heavy, "heavy"))
    assert analysis.tes["light"].intensity == pytest.approx(light / 8) and analysis.tes["light"].klass == "MI"
    assert analysis.tes["heavy"].intensity == pytest.approx(heavy / 8) and analysis.tes["heavy"].klass == "CI"


def test_broadcast_traffic_counts_distinct_elements():
    X, b = te.placeholder((128, 64), name="X"), te.placeholder((64,), name="b")
    add = analysis_of(te.compute((128, 64), lambda i, j: X[i, j] + b[j], name="add")).tes["add"]
    assert add.loads == 2 * 128 * 64
    assert add.traffic_bytes == 4 * (128 * 64 + 64 + 128 * 64)  # b is read 128 times but moved once


def test_live_ranges_and_peak():
    A = te.placeholder((256,), name="A")
    W = te.placeholder((256,), name="W")
    B = te.compute((256,), lambda i: A[i] * W[i], name="B")
    C = te.compute((256,), lambda i: B[i] + 1.0, name="C")
    D = te.compute((256,), lambda i: B[i] + C[i], name="D")
    E = te.compute((128,), lambda i: D[2 * i], name="E")
    analysis = analysis_of(E, params=[W])
    tensors = analysis.tensors
    assert [t.index for t in analysis.tes.values()] == [0, 1, 2, 3]
    assert (tensors["A"].kind, tensors["W"].kind, tensors["B"].kind, tensors["E"].kind) == \
        ("input", "param", "intermediate", "output")
    assert tensors["A"].live == (-1, 0) and tensors["B"].live == (0, 2) and tensors["C"].live == (1, 2)
    assert tensors["E"].live == (3, 4)  # a program output outlives the program
    assert tensors["B"].readers == ("C", "D") and tensors["B"].producer == "B"
    assert analysis.peak.bytes == 3 * 1024 and analysis.peak.step == 2 and analysis.peak.te == "D"


def test_spatial_and_temporal_reuse():
    x, Wq, Wk, Wv = (te.placeholder((8, 8), name=n) for n in ("x", "Wq", "Wk", "Wv"))
    q, k, v = matmul(x, Wq, "q"), matmul(x, Wk, "k"), matmul(x, Wv, "v")
    residual = te.compute((8, 8), lambda i, j: x[i, j] + q[i, j] + k[i, j] + v[i, j], name="residual")
    R = te.placeholder((8, 8), name="R")
    h = residual
    for t in range(3):  # a recurrence: every step reads R again
        h = matmul(h, R, f"step{t}")
    analysis = analysis_of(h, params=[Wq, Wk, Wv, R])
    spatial = {s.tensor: s for s in analysis.spatial_reuse}
    temporal = {t.tensor: t for t in analysis.temporal_reuse}
    assert spatial["x"].readers == ("q", "k", "v", "residual") and spatial["x"].independent == ("q", "k", "v")
    assert analysis.spatial_reuse[0].tensor == "x"  # the largest independent set comes first
    assert spatial["R"].independent == ("step0",)
    assert temporal["R"].kind == "param" and temporal["R"].rereads == 2 and temporal["R"].saved_bytes == 2 * 256
    assert temporal["R"].span == analysis.tes["step2"].index - analysis.tes["step0"].index
    assert analysis.temporal_reuse[0].tensor == "R"
    assert temporal["x"].rereads == 1  # the residual depends on q, which read x before
    assert "Wq" not in spatial  # one reader: no reuse across TEs


def test_clashing_names_are_made_unique():
    A = te.placeholder((4,), name="A")
    first = te.compute((4,), lambda i: A[i] + 1.0, name="compute")
    second = te.compute((4,), lambda i: first[i] * 2.0, name="compute")
    analysis = analysis_of(second)
    assert list(analysis.tes) == ["compute", "compute_1"]
    assert analysis.tes["compute_1"].access("compute").tensor == "compute"
    assert analysis.te_of(second.op).name == "compute_1"


def test_multi_output_te():
    A = te.placeholder((4,), name="A")
    plus, times = te.compute((4,), lambda i: (A[i] + 1.0, A[i] * 2.0), name="pair")
    out = te.compute((4,), lambda i: plus[i] - times[3 - i], name="out")
    analysis = analysis_of(out)
    pair = analysis.tes["pair"]
    assert pair.bytes == 2 * 16 and pair.stores == 8 and pair.flops == 8
    assert set(analysis.tensors) >= {"pair_0", "pair_1"} and analysis.tensors["pair_1"].producer == "pair"
    assert maps_equal(analysis.chain_map(["out", "pair_1", "A"]), "{ out[i] -> A[3 - i] : 0 <= i < 4 }")


def test_analysis_leaves_the_program_alone():
    A = te.placeholder((4,), name="A")
    out = te.compute((4,), lambda i: A[i] + 1.0, name="out")
    program = TEProgram(inputs={"A": A}, params={}, param_tensors={}, outputs={"out": out})
    before = program.stages
    first, second = analyze(program), analyze(program)
    assert all(a.same_as(b) for a, b in zip(program.stages, before))
    assert [t.flops for t in first.tes.values()] == [t.flops for t in second.tes.values()]
