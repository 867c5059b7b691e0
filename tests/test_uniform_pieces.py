"""schedule/pieces.py: a row of stacked maps selected by comparisons with constants (the epilogue of
horizontally stacked GEMMs) is vectorized within its uniform pieces, reads contiguously, and computes what
numpy does; a row whose condition is not a comparison with constants keeps the injective rule's loop."""

import re

import numpy as np
import tvm
from tvm import s_tir, te, tirx

from souffle_py.codegen.stack_locals import PIPELINE
from souffle_py.cpu_target import using
from souffle_py.schedule.pieces import uniform_piece
from souffle_py.schedule.rules.injective import schedule_injective

AVX512 = "llvm -mcpu=sapphirerapids"


def _stacked(rows=4, width=48, parts=3):
    """out[0, i, j] = acc[j // width, i, j % width] * scale[part of j] + bias[j]: three GEMMs' int32 sums
    stacked, scaled per GEMM (te_passes/horizontal.py's concat of dynamically quantized Q / K / V)."""
    acc = te.placeholder((parts, rows, width), "int32", name="acc")
    scale, bias = te.placeholder((parts,), name="scale"), te.placeholder((parts * width,), name="bias")

    def value(_, i, j):
        chosen = scale[parts - 1]
        for p in reversed(range(parts - 1)):
            chosen = tirx.if_then_else(j < (p + 1) * width, scale[p], chosen)
        return acc[j // width, i, j % width].astype("float32") * chosen + bias[j]

    return [acc, scale, bias, te.compute((1, rows, parts * width), value, name="out")]


def _loops(func) -> list[str]:
    return re.findall(r"T\.(parallel|vectorized|serial|unroll)\((\d+)", func.script())


def test_the_piece_is_the_gcd_of_the_row_and_its_constants():
    tensors = _stacked(width=48)
    func = te.create_prim_func(tensors)
    with using(AVX512):
        sch = s_tir.Schedule(func)
        stmt = sch.get(sch.get_sblock("out"))
        assert uniform_piece(stmt, stmt.iter_vars[-1].var, 144) == 48
        # a stack whose parts no vector divides (40 columns each, 16 lanes): no piece
        narrow = te.create_prim_func(_stacked(width=40))
        sch = s_tir.Schedule(narrow)
        stmt = sch.get(sch.get_sblock("out"))
        assert uniform_piece(stmt, stmt.iter_vars[-1].var, 120) == 0


def test_a_stacked_epilogue_is_vectorized_in_pieces_and_exact():
    tensors = _stacked(rows=64, width=64)
    with using(AVX512):
        sch = s_tir.Schedule(te.create_prim_func(tensors))
        schedule_injective(sch, sch.get_sblock("out"))
        # before: one scalar parallel loop over all 64 x 192 points; now 64 rows x 3 pieces x 4 vectors
        assert _loops(sch.mod["main"]) == [("parallel", "768"), ("vectorized", "16")]
    lib = tvm.compile(sch.mod, target="llvm", tir_pipeline=PIPELINE)
    rng = np.random.default_rng(0)
    acc = rng.integers(-1000, 1000, (3, 64, 64)).astype(np.int32)
    scale, bias = rng.random(3).astype(np.float32), rng.random(192).astype(np.float32)
    out = tvm.runtime.tensor(np.zeros((1, 64, 192), np.float32))
    lib["main"](*(tvm.runtime.tensor(v) for v in (acc, scale, bias)), out)
    expected = (acc.astype(np.float32) * scale[:, None, None] + bias.reshape(3, 1, 64)).transpose(1, 0, 2)
    np.testing.assert_allclose(out.numpy().reshape(64, 3, 64), expected, rtol=1e-6)


def test_a_lane_dependent_condition_keeps_the_scalar_loop():
    """j % 8 < 4 (a rotary embedding's halves) is no comparison of the row with a constant: left alone."""
    x = te.placeholder((4, 64), name="x")
    y = te.compute((4, 64), lambda i, j: tirx.if_then_else(j % 8 < 4, x[i, j], -x[i, j]), name="y")
    with using(AVX512):
        sch = s_tir.Schedule(te.create_prim_func([x, y]))
        stmt = sch.get(sch.get_sblock("y"))
        assert uniform_piece(stmt, stmt.iter_vars[-1].var, 64) == 0
