"""te_passes/layout.py: constant GEMM weights packed into column panels, and computed operands read across
their columns copied transposed, compute the same values."""

import numpy as np
import pytest
from tvm import te

from models.registry import build_model
from souffle_py.cpu_target import using
from souffle_py.frontend import import_onnx
from souffle_py.ir.program import TEProgram
from souffle_py.schedule.budgets import gemm_tile_columns
from te_passes.check import assert_same_outputs
from te_passes.layout import pack_weights, transpose_gemv_weights, transpose_operands
from souffle_py.ir.marks import member_of
from test_cpu_target import HASWELL, SPR

TILE_J = gemm_tile_columns()  # the host's: what a test outside cpu_target.using compiles for


def _gemm_program(rows: int, k: int, n: int) -> TEProgram:
    x = te.placeholder((1, rows, k), name="x")
    w = te.placeholder((k, n), name="w")
    r = te.reduce_axis((0, k), name="r")
    y = te.compute((1, rows, n), lambda b, i, j: te.sum(x[b, i, r] * w[r, j], axis=r), name="y")
    value = np.random.default_rng(0).standard_normal((k, n)).astype(np.float32)
    return TEProgram(inputs={"x": x}, params={"w": value}, param_tensors={"w": w}, outputs={"y": y})


def test_gemm_weights_are_packed_and_values_kept():
    program = _gemm_program(rows=12, k=40, n=4 * TILE_J)
    packed = pack_weights(program, TILE_J)
    assert list(packed.params) == [f"w_panels{TILE_J}"]  # the row-major weight is no longer read
    assert packed.params[f"w_panels{TILE_J}"].shape == (4, 40, TILE_J)
    assert_same_outputs(program, packed)


def test_transposed_weights_of_a_gemm_are_packed_into_the_same_panels():
    """ONNX Gemm with transB (torch's nn.Linear over 2-D inputs) reads a [N, K] weight as W[j, k]: packed
    into [N / P, K, P] panels like a [K, N] weight, so the register tile's column vector is one load."""
    rows, k, n = 7, 24, 2 * TILE_J
    x = te.placeholder((rows, k), name="x")
    w = te.placeholder((n, k), name="w")
    r = te.reduce_axis((0, k), name="r")
    y = te.compute((rows, n), lambda i, j: te.sum(x[i, r] * w[j, r], axis=r), name="y")
    value = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32)
    program = TEProgram(inputs={"x": x}, params={"w": value}, param_tensors={"w": w}, outputs={"y": y})
    packed = pack_weights(program, TILE_J)
    assert list(packed.params) == [f"w_panels{TILE_J}t"]
    np.testing.assert_array_equal(packed.params[f"w_panels{TILE_J}t"][1, :, 3], value[TILE_J + 3])
    assert_same_outputs(program, packed)
    x1 = te.placeholder((1, k), name="x")
    gemv = TEProgram(inputs={"x": x1}, params={"w": value}, param_tensors={"w": w},
                     outputs={"y": te.compute((1, n), lambda i, j: te.sum(x1[i, r] * w[j, r], axis=r), name="y")})
    assert pack_weights(gemv, TILE_J) is gemv  # a GEMV keeps its [N, K] rows, read along k


# tiles of two vectors over the 10 steps: 5 rows in AVX-512's 20 accumulators, 4 (the last tile masked) in AVX2's 8
@pytest.mark.parametrize("target,rows", [(HASWELL, 4), (SPR, 5)])
def test_weights_with_an_output_axis_in_front_are_packed_per_slice(target, rows):
    """A bidirectional input projection, y[t, d, b, j] = sum_k x[t, b, k] * W[d, k, j]: each direction's
    [K, N] weight packed alike, [D, N / P, K, P]; the schedule then runs each direction as one GEMM over its
    panels (schedule/default.py)."""
    from souffle_py.schedule.default import schedule_cpu

    with using(target):
        tile_j = gemm_tile_columns()
        steps, dirs, k, n = 10, 2, 24, 2 * tile_j
        x = te.placeholder((steps, 1, k), name="x")
        w = te.placeholder((dirs, k, n), name="w")
        r = te.reduce_axis((0, k), name="r")
        y = te.compute((steps, dirs, 1, n), lambda t, d, b, j: te.sum(x[t, b, r] * w[d, r, j], axis=r), name="y")
        value = np.random.default_rng(0).standard_normal((dirs, k, n)).astype(np.float32)
        program = TEProgram(inputs={"x": x}, params={"w": value}, param_tensors={"w": w}, outputs={"y": y})
        packed = pack_weights(program, tile_j)
        assert list(packed.params) == [f"w_panels{tile_j}"]
        assert packed.params[f"w_panels{tile_j}"].shape == (dirs, 2, k, tile_j)
        (op,) = packed.stages
        text = schedule_cpu(te.create_prim_func([packed.inputs["x"], packed.param_tensors[f"w_panels{tile_j}"],
                                                 op.output(0)])).script()
        assert f"T.vectorized({tile_j})" in text and f"T.unroll({rows})" in text  # rows x tile_j tiles
    assert_same_outputs(program, packed)

@pytest.mark.parametrize("rows,n", [(1, 4 * TILE_J), (3, 4 * TILE_J), (12, 4 * TILE_J + 1)])
def test_gemvs_and_ragged_widths_keep_the_row_major_weight(rows, n):
    program = _gemm_program(rows=rows, k=8, n=n)
    assert pack_weights(program, TILE_J) is program


def test_models_keep_their_values_and_recurrences_their_weights():
    for name in ("bert", "lstm"):
        program = import_onnx(build_model(name, tiny=True, hidden=64) if name == "lstm"
                              else build_model(name, tiny=True))
        packed = pack_weights(program, TILE_J)
        assert any("panels" in p for p in packed.params)
        assert_same_outputs(program, packed, rtol=1e-5, atol=1e-5)
        for op in packed.stages:  # the recurrent GEMV runs once per step: its weight stays row-major
            if member_of(op) is not None:
                assert not any("panels" in t.op.name for t in op.input_tensors)


def test_attention_scores_read_keys_from_a_transposed_copy():
    """Q.K^T reads K[j, k] (its columns j a row apart): the GEMM reads a [.., k, j] copy instead; the value
    GEMM (P.V, reading V[k, j]) and the weight GEMMs are left alone."""
    from souffle_py.passes import transformed

    program = transformed(import_onnx(build_model("bert", tiny=True)))[0]
    after = transpose_operands(program)
    copies = [op for op in after.stages if op.name.endswith("_operand_t")]
    assert [op.name for op in copies] == ["layer0_attn_scores_operand_t", "layer1_attn_scores_operand_t"]
    scores = next(op for op in after.stages if op.name == "layer0_attn_scores")
    assert copies[0].output(0) in list(scores.input_tensors)
    assert after.origins["layer0_attn_scores_operand_t"] == program.origins["layer0_attn_scores"]  # in describe()
    assert transpose_operands(_gemm_program(rows=12, k=40, n=32)).stages[0].name == "y"
    assert_same_outputs(program, after)


def test_gemv_weights_are_stored_transposed_for_the_gpu_and_values_kept():
    """A GEMV (rows below the bound) reads its constant weight as Wt[j, k], the reduction innermost; a
    GEMM keeps W[k, j]. Recurrence steps count one step's rows: the LSTM's recurrent projections are
    GEMVs (batch 1) although their TEs span all steps."""
    program = _gemm_program(rows=3, k=40, n=24)
    transposed = transpose_gemv_weights(program, max_rows=16)
    assert list(transposed.params) == ["w_t"] and transposed.params["w_t"].shape == (24, 40)
    assert_same_outputs(program, transposed)
    assert transpose_gemv_weights(_gemm_program(rows=16, k=40, n=24), max_rows=16).params.keys() == {"w"}
    lstm = import_onnx(build_model("lstm", tiny=True))
    stepped = transpose_gemv_weights(lstm, max_rows=16)
    recurrent = {op.name for op in lstm.stages if op.reduce_axis and member_of(op) is not None}
    reads_transposed = {op.name for op in stepped.stages
                        if any(t.op.name.endswith("_t") for t in op.input_tensors)}
    assert recurrent and recurrent <= reads_transposed
    assert_same_outputs(lstm, stepped)
