"""Element-level analysis: isl dependence maps of hand-built TEs, checked against maps worked out by hand.

Each expected map is written the way one would derive it from the TE's index expressions; maps_equal asks
isl whether the two relate exactly the same elements. M follows the paper: one row per output dimension,
element v reads v @ M + c.
"""

from __future__ import annotations

import numpy as np
import pytest
from tvm import te, tirx, topi

from souffle_py.ir.program import TEProgram
from souffle_py.ir.analysis import (DATA_DEPENDENT, ONE_RELIES_ON_MANY, ONE_RELIES_ON_ONE, ONE_TO_MANY, ONE_TO_ONE,
                                affine_form, analyze, compose, image, maps_equal, parse_map)


def analysis_of(*outputs):
    program = TEProgram(inputs={}, params={}, param_tensors={}, outputs={f"out{i}": t for i, t in enumerate(outputs)})
    return analyze(program)


def check_affine(access, M, c):
    assert access.kind == ONE_TO_ONE and access.single_valued and access.exact
    np.testing.assert_array_equal(access.M, np.array(M))
    np.testing.assert_array_equal(access.c, np.array(c))


def test_transpose():
    A = te.placeholder((2, 3, 4), name="A")
    T = te.compute((4, 2, 3), lambda i, j, k: A[j, k, i], name="T")
    access = analysis_of(T).tes["T"].access("A")
    assert maps_equal(access.map, "{ T[i, j, k] -> A[j, k, i] : 0 <= i < 4 and 0 <= j < 2 and 0 <= k < 3 }")
    check_affine(access, [[0, 0, 1], [1, 0, 0], [0, 1, 0]], [0, 0, 0])
    assert access.injective


def test_strided_slice():
    B = te.placeholder((8, 5), name="B")
    S = te.compute((3, 4), lambda i, j: B[2 * i + 1, j + 1], name="S")
    access = analysis_of(S).tes["S"].access("B")
    assert maps_equal(access.map, "{ S[i, j] -> B[2i + 1, j + 1] : 0 <= i < 3 and 0 <= j < 4 }")
    check_affine(access, [[2, 0], [0, 1]], [1, 1])


def test_reshape_is_quasi_affine():
    A = te.placeholder((2, 3, 4), name="A")
    access = analysis_of(topi.reshape(A, (6, 4))).tes["T_reshape"].access("A")
    assert maps_equal(access.map, "{ T_reshape[i, j] -> A[floor(i / 3), i mod 3, j] : 0 <= i < 6 and 0 <= j < 4 }")
    assert access.kind == ONE_TO_ONE and access.injective and access.exact
    assert access.M is None  # floordiv/floormod: quasi-affine, no M*v+c


def test_reshape_that_splits_the_last_axis_is_affine():
    """isl sees that floor((64 i + 16 j + k) / 64) = i inside the domain, so the map is plainly affine."""
    X = te.placeholder((16, 64), name="X")
    access = analysis_of(topi.reshape(X, (16, 4, 16))).tes["T_reshape"].access("X")
    check_affine(access, [[1, 0], [0, 16], [0, 1]], [0, 0])


def test_flatten():
    F = te.placeholder((2, 3, 4), name="F")
    access = analysis_of(topi.nn.flatten(F)).tes["compute"].access("F")
    assert maps_equal(access.map, "{ compute[i, j] -> F[i, floor(j / 4), j mod 4] : 0 <= i < 2 and 0 <= j < 12 }")
    assert access.M is None and access.injective


def test_broadcast_is_single_valued_but_not_injective():
    X = te.placeholder((3, 4), name="X")
    b = te.placeholder((4,), name="b")
    row = te.placeholder((3, 1), name="row")
    O = te.compute((3, 4), lambda i, j: X[i, j] + b[j] + row[i, 0], name="O")
    te_info = analysis_of(O).tes["O"]
    bias, rows, x = te_info.access("b"), te_info.access("row"), te_info.access("X")
    assert maps_equal(bias.map, "{ O[i, j] -> b[j] : 0 <= i < 3 and 0 <= j < 4 }")
    check_affine(bias, [[0], [1]], [0])
    check_affine(rows, [[1, 0], [0, 0]], [0, 0])
    assert not bias.injective and not rows.injective and x.injective
    assert te_info.dependence == ONE_RELIES_ON_ONE


def test_concat_is_piecewise():
    x = te.placeholder((2, 3), name="x")
    y = te.placeholder((4, 3), name="y")
    te_info = analysis_of(topi.concatenate([x, y], 0)).tes["T_concat"]
    from_x, from_y = te_info.access("x"), te_info.access("y")
    assert maps_equal(from_x.map, "{ T_concat[i, j] -> x[i, j] : 0 <= i < 2 and 0 <= j < 3 }")
    assert maps_equal(from_y.map, "{ T_concat[i, j] -> y[i - 2, j] : 2 <= i < 6 and 0 <= j < 3 }")
    check_affine(from_x, [[1, 0], [0, 1]], [0, 0])
    check_affine(from_y, [[1, 0], [0, 1]], [-2, 0])


def test_matmul_is_one_relies_on_many():
    A = te.placeholder((4, 6), name="A")
    B = te.placeholder((6, 5), name="B")
    k = te.reduce_axis((0, 6), name="k")
    C = te.compute((4, 5), lambda i, j: te.sum(A[i, k] * B[k, j], axis=k), name="C")
    te_info = analysis_of(C).tes["C"]
    a, b = te_info.access("A"), te_info.access("B")
    assert maps_equal(a.map, "{ C[i, j] -> A[i, rk] : 0 <= i < 4 and 0 <= j < 5 and 0 <= rk < 6 }")
    assert maps_equal(b.map, "{ C[i, j] -> B[rk, j] : 0 <= i < 4 and 0 <= j < 5 and 0 <= rk < 6 }")
    assert a.kind == b.kind == ONE_TO_MANY and a.M is None and not a.injective
    assert te_info.dependence == ONE_RELIES_ON_MANY
    assert image(a.map, (1, 2)).is_equal(parse_map("{ [] -> A[1, rk] : 0 <= rk < 6 }").range())


def test_batch_matmul():
    A = te.placeholder((2, 4, 6), name="A")
    B = te.placeholder((2, 6, 5), name="B")
    k = te.reduce_axis((0, 6), name="k")
    C = te.compute((2, 4, 5), lambda n, i, j: te.sum(A[n, i, k] * B[n, k, j], axis=k), name="C")
    te_info = analysis_of(C).tes["C"]
    domain = "0 <= n < 2 and 0 <= i < 4 and 0 <= j < 5 and 0 <= rk < 6"
    assert maps_equal(te_info.access("A").map, f"{{ C[n, i, j] -> A[n, i, rk] : {domain} }}")
    assert maps_equal(te_info.access("B").map, f"{{ C[n, i, j] -> B[n, rk, j] : {domain} }}")


def test_softmax():
    x = te.placeholder((4, 6), name="x")
    analysis = analysis_of(topi.nn.softmax(x, axis=1))
    maxelem, exp, expsum, norm = (analysis.tes[f"T_softmax_{n}"] for n in ("maxelem", "exp", "expsum", "norm"))
    assert maps_equal(maxelem.access("x").map, "{ T_softmax_maxelem[i] -> x[i, r] : 0 <= i < 4 and 0 <= r < 6 }")
    assert maps_equal(expsum.access("T_softmax_exp").map,
                      "{ T_softmax_expsum[i] -> T_softmax_exp[i, r] : 0 <= i < 4 and 0 <= r < 6 }")
    check_affine(exp.access("T_softmax_maxelem"), [[1], [0]], [0])
    check_affine(norm.access("T_softmax_exp"), [[1, 0], [0, 1]], [0, 0])
    assert [t.dependence for t in (maxelem, exp, expsum, norm)] == \
        [ONE_RELIES_ON_MANY, ONE_RELIES_ON_ONE, ONE_RELIES_ON_MANY, ONE_RELIES_ON_ONE]
    # Every output element depends on its whole row of x, through the max and the sum.
    assert maps_equal(analysis.dependence("T_softmax_norm", "x"),
                      "{ T_softmax_norm[i, j] -> x[i, r] : 0 <= i < 4 and 0 <= j < 6 and 0 <= r < 6 }")


def test_conv2d_with_stride_and_padding():
    data = te.placeholder((1, 3, 8, 8), name="data")
    weight = te.placeholder((4, 3, 3, 3), name="w")
    analysis = analysis_of(topi.nn.conv2d_nchw(data, weight, stride=2, padding=1, dilation=1))
    pad, conv = analysis.tes["pad_temp"], analysis.tes["conv2d_nchw"]
    # The padded border reads nothing: the if_then_else guard restricts the map's domain.
    assert maps_equal(pad.access("data").map,
                      "{ pad_temp[0, c, h, w] -> data[0, c, h - 1, w - 1] : "
                      "0 <= c < 3 and 1 <= h <= 8 and 1 <= w <= 8 }")
    # The batch dimension has extent 1: isl writes its index as the constant 0, so its row of M is zero.
    check_affine(pad.access("data"), np.diag([0, 1, 1, 1]), [0, 0, -1, -1])
    out = "0 <= f < 4 and 0 <= y < 4 and 0 <= x < 4 and 0 <= c < 3"
    assert maps_equal(conv.access("pad_temp").map, f"{{ conv2d_nchw[0, f, y, x] -> pad_temp[0, c, h, w] : {out} "
                                                   "and 2y <= h <= 2y + 2 and 2x <= w <= 2x + 2 }")
    assert maps_equal(conv.access("w").map, f"{{ conv2d_nchw[0, f, y, x] -> w[f, c, kh, kw] : {out} "
                                            "and 0 <= kh < 3 and 0 <= kw < 3 }")
    assert maps_equal(analysis.chain_map(["conv2d_nchw", "pad_temp", "data"]),
                      f"{{ conv2d_nchw[0, f, y, x] -> data[0, c, h, w] : {out} and 2y - 1 <= h <= 2y + 1 "
                      "and 2x - 1 <= w <= 2x + 1 and 0 <= h < 8 and 0 <= w < 8 }")
    assert (conv.klass, pad.klass) == ("CI", "MI")


def figure4():
    """The paper's Figure 4: relu -> strided_slice -> permute."""
    A = te.placeholder((4, 8), name="A")
    B = te.compute((4, 8), lambda i, j: tirx.if_then_else(A[i, j] > 0, A[i, j], tirx.const(0.0, "float32")), name="B")
    C = te.compute((2, 4), lambda i, j: B[2 * i, j], name="C")
    return te.compute((4, 2), lambda i, j: C[j, i], name="D")


def test_figure4_chain_composes_to_the_papers_matrix():
    analysis = analysis_of(figure4())
    composed = analysis.chain_map(["D", "C", "B", "A"])
    assert maps_equal(composed, "{ D[i, j] -> A[2j, i] : 0 <= i < 4 and 0 <= j < 2 }")
    M, c = affine_form(composed)
    np.testing.assert_array_equal(M, [[0, 1], [2, 0]])
    np.testing.assert_array_equal(c, [0, 0])
    # Each step's own matrix, as in the paper's product [[0,1],[1,0]] x [[2,0],[0,1]] x I.
    check_affine(analysis.tes["D"].access("C"), [[0, 1], [1, 0]], [0, 0])
    check_affine(analysis.tes["C"].access("B"), [[2, 0], [0, 1]], [0, 0])
    check_affine(analysis.tes["B"].access("A"), [[1, 0], [0, 1]], [0, 0])  # a data-dependent guard restricts nothing
    assert maps_equal(analysis.dependence("D", "A"), composed)
    assert image(composed, (3, 1)).is_equal(parse_map("{ [] -> A[2, 3] }").range())


def test_gather_is_data_dependent_and_not_guessed():
    table = te.placeholder((10, 4), name="table")
    idx = te.placeholder((5,), "int64", name="idx")
    G = te.compute((5, 4), lambda i, j: table[idx[i].astype("int32"), j], name="G")
    te_info = analysis_of(G).tes["G"]
    rows = te_info.access("table")
    assert rows.kind == DATA_DEPENDENT and not rows.exact and rows.M is None
    # The row is unknown: the map spans the table's whole extent in that dimension.
    assert maps_equal(rows.map, "{ G[i, j] -> table[t, j] : 0 <= i < 5 and 0 <= j < 4 and 0 <= t < 10 }")
    check_affine(te_info.access("idx"), [[1], [0]], [0])
    assert te_info.dependence == DATA_DEPENDENT


def test_select_chain_gives_one_piece_per_step():
    """The LSTM's Y = h_t at step t, spelled as nested Selects."""
    hs = [te.placeholder((4,), name=f"h{t}") for t in range(3)]
    Y = te.compute((3, 4), lambda t, j: tirx.Select(t == 0, hs[0][j], tirx.Select(t == 1, hs[1][j], hs[2][j])),
                   name="Y")
    te_info = analysis_of(Y).tes["Y"]
    for t in range(3):
        assert maps_equal(te_info.access(f"h{t}").map, f"{{ Y[{t}, j] -> h{t}[j] : 0 <= j < 4 }}")


def test_min_max_indices_are_piecewise():
    x = te.placeholder((4, 6), name="x")
    clamp = te.compute((6,), lambda i: x[tirx.min(i, 3), tirx.max(i - 2, 0)], name="clamp")
    access = analysis_of(clamp).tes["clamp"].access("x")
    assert maps_equal(access.map, "{ clamp[i] -> x[i, 0] : 0 <= i <= 2; clamp[i] -> x[3, i - 2] : 3 <= i <= 5 }")
    assert access.kind == ONE_TO_ONE and access.M is None  # two affine pieces: no single M


def test_reduction_condition_restricts_the_region():
    A = te.placeholder((4, 4), name="A")
    k = te.reduce_axis((0, 4), name="k")
    S = te.compute((4,), lambda i: te.sum(A[i, k], axis=k, where=k < i), name="S")
    assert maps_equal(analysis_of(S).tes["S"].access("A").map, "{ S[i] -> A[i, k] : 0 <= k < i < 4 }")


def test_several_fixed_reads_are_one_to_many():
    """An element that reads two positions of one tensor depends on two elements (the LSTM's gate slices)."""
    X = te.placeholder((5,), name="X")
    S = te.compute((4,), lambda i: X[i] + X[i + 1], name="S")
    access = analysis_of(S).tes["S"].access("X")
    assert maps_equal(access.map, "{ S[i] -> X[i] : 0 <= i < 4; S[i] -> X[i + 1] : 0 <= i < 4 }")
    assert access.kind == ONE_TO_MANY and access.exact


def test_non_affine_index_is_over_approximated():
    X = te.placeholder((4, 4), name="X")
    N = te.compute((4, 4), lambda i, j: X[(i * j) % 4, j], name="N")
    access = analysis_of(N).tes["N"].access("X")
    assert not access.exact and access.kind == ONE_TO_MANY
    assert maps_equal(access.map, "{ N[i, j] -> X[r, j] : 0 <= i < 4 and 0 <= j < 4 and 0 <= r < 4 }")


def test_rank0_tensor():
    X = te.placeholder((3,), name="X")
    s = te.placeholder((), name="s")
    O = te.compute((3,), lambda i: X[i] * s(), name="O")
    access = analysis_of(O).tes["O"].access("s")
    assert maps_equal(access.map, "{ O[i] -> s[] : 0 <= i < 3 }")
    assert access.M.shape == (1, 0)


def test_dependence_unions_every_path():
    X = te.placeholder((5,), name="X")
    P1 = te.compute((4,), lambda i: X[i] * 2.0, name="P1")
    P2 = te.compute((4,), lambda i: X[i + 1] * 3.0, name="P2")
    S = te.compute((4,), lambda i: P1[i] + P2[i], name="S")
    analysis = analysis_of(S)
    assert maps_equal(analysis.dependence("S", "X"), "{ S[i] -> X[i] : 0 <= i < 4; S[i] -> X[i + 1] : 0 <= i < 4 }")
    assert maps_equal(analysis.chain_map(["S", "P2", "X"]), "{ S[i] -> X[i + 1] : 0 <= i < 4 }")
    with pytest.raises(ValueError):
        analysis.dependence("P1", "P2")


def test_compose_rejects_maps_that_do_not_chain():
    with pytest.raises(ValueError, match="cannot compose"):
        compose([parse_map("{ A[i] -> B[i] }"), parse_map("{ C[i] -> D[i] }")])
    assert maps_equal(compose([parse_map("{ A[i] -> B[i + 1] }"), parse_map("{ B[i] -> C[2i] }")]),
                      "{ A[i] -> C[2i + 2] }")
    assert not maps_equal(parse_map("{ A[i] -> B[i] }"), "{ A[i] -> C[i] }")


def test_a_comparison_past_the_isl_budget_is_undecided(monkeypatch):
    """A comparison isl cannot settle within ISL_MAX_OPERATIONS answers "not equal" (callers then keep their
    TEs as they are: MobileViTv2's fold / unfold maps took isl more than 10 minutes); the budget applies to
    that comparison only."""
    from souffle_py.ir.analysis import element_level
    a = "{ A[i] -> B[o] : 0 <= i < 65536 and o = 16 * floor(i / 16) + (i mod 16) }"
    b = "{ A[i] -> B[i] : 0 <= i < 65536 }"
    monkeypatch.setattr(element_level, "ISL_MAX_OPERATIONS", 1)
    assert not maps_equal(parse_map(a), b)
    assert element_level.CONTEXT.get_max_operations() == 0
    monkeypatch.undo()
    assert maps_equal(parse_map(a), b)
