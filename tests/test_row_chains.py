"""schedule/rules/row_chain.py: softmax and LayerNorm chains over data beyond the caches run row by row under
one parallel loop, compute what the stage-by-stage schedule computes, and smaller chains keep their own
loops."""

import numpy as np
import pytest
import tvm
from tvm import s_tir, te, topi

from souffle_py.cpu_target import using
from souffle_py.schedule.blocks import vector_lanes
from souffle_py.schedule.default import schedule_blocks, schedule_cpu
from souffle_py.schedule.thresholds import ROW_CHAIN_MIN_BYTES
from souffle_py.target import resolve_target
from test_cpu_target import SPR

TARGET = resolve_target("llvm")
VECTOR = vector_lanes()  # the host's: what a test outside cpu_target.using compiles for


def _softmax(shape):
    x = te.placeholder(shape, name="x")
    *_, columns = shape
    k, k2 = te.reduce_axis((0, columns), "k"), te.reduce_axis((0, columns), "k2")
    row = (*shape[:-1], 1)
    mx = te.compute(row, lambda *i: te.max(x[(*i[:-1], k)], axis=k), name="mx")
    es = te.compute(row, lambda *i: te.sum(te.exp(x[(*i[:-1], k2)] - mx[(*i[:-1], 0)]), axis=k2), name="es")
    y = te.compute(shape, lambda *i: te.exp(x[i] - mx[(*i[:-1], 0)]) / es[(*i[:-1], 0)], name="y")
    return [x, y]


def _layer_norm(rows, columns):
    x = te.placeholder((rows, columns), name="x")
    k, k2 = te.reduce_axis((0, columns), "k"), te.reduce_axis((0, columns), "k2")
    mean = te.compute((rows, 1), lambda i, _: te.sum(x[i, k] / columns, axis=k), name="mean")
    var = te.compute((rows, 1), lambda i, _: te.sum(te.power(x[i, k2] - mean[i, 0], 2.0) / columns, axis=k2),
                     name="var")
    inv_std = te.compute((rows, 1), lambda i, _: 1.0 / te.sqrt(var[i, 0] + 1e-5), name="inv_std")
    y = te.compute((rows, columns), lambda i, j: (x[i, j] - mean[i, 0]) * inv_std[i, 0], name="y")
    return [x, y]


def _run(func, value):
    lib = tvm.compile(func, target=TARGET)
    out = tvm.runtime.tensor(np.zeros_like(value))
    lib["main"](tvm.runtime.tensor(value), out)
    return out.numpy()


def _rows(shape):
    return np.random.default_rng(0).standard_normal(shape).astype(np.float32) * 3


@pytest.mark.parametrize("shape", [(1, 2, 512, 1024), (1, 1, 700, 1500)])  # 1500 columns: a masked last vector
def test_a_softmax_beyond_the_caches_runs_row_by_row(shape):
    assert np.prod(shape) * 4 >= ROW_CHAIN_MIN_BYTES
    func = schedule_cpu(te.create_prim_func(_softmax(shape)))
    assert func.script().count("T.parallel(") == 1  # max, sum and output under one row loop
    assert f"T.vectorized({VECTOR})" in func.script()
    value = _rows(shape)
    e = np.exp(value - value.max(-1, keepdims=True))
    np.testing.assert_allclose(_run(func, value), e / e.sum(-1, keepdims=True), rtol=1e-5, atol=1e-6)


def test_a_row_max_only_4_lanes_divide_keeps_several_vectors_of_partials():
    """Whisper's 1500-key softmax max (TVM cannot mask a max): 60 lanes of partial maxima under the row, not
    one 4-lane dependent chain of vmaxps. Compiled for AVX-512, where 4 lanes are a quarter vector (AVX2 runs
    them as half of one; reductions.py widens a quarter only)."""
    shape = (1, 1, 700, 1500)
    with using(SPR):
        script = schedule_cpu(te.create_prim_func(_softmax(shape))).script().splitlines()
    lanes = [int(line.split("T.vectorized(")[1].split(")")[0]) for line, nxt in zip(script, script[1:])
             if "T.vectorized(" in line and "mx_rf_update" in nxt]
    assert lanes == [60]


def test_a_layer_norm_chain_takes_its_elementwise_row_stage_along():
    func = schedule_cpu(te.create_prim_func(_layer_norm(2100, 512)))
    assert func.script().count("T.parallel(") == 1
    value = _rows((2100, 512))
    mean, var = value.mean(-1, keepdims=True), value.var(-1, keepdims=True)
    np.testing.assert_allclose(_run(func, value), (value - mean) / np.sqrt(var + 1e-5), rtol=1e-4, atol=1e-4)


def test_a_chain_within_the_caches_keeps_its_stages_loops():
    """BERT-base's 12 x 128 x 128 scores (786 KB): each stage its own parallel loop, as before."""
    func = schedule_cpu(te.create_prim_func(_softmax((1, 12, 128, 128))))
    assert func.script().count("T.parallel(") == 3


def test_a_reduction_read_outside_the_chain_keeps_its_own_loops():
    x, y = _softmax((1, 2, 512, 1024))
    (mx,) = [t for t in y.op.input_tensors if t.op.name == "mx"]
    other = te.compute(mx.shape, lambda *i: mx[i] * 2.0, name="other")
    out = topi.sum(y, axis=3, keepdims=True) + other
    func = schedule_cpu(te.create_prim_func([x, out]))
    assert func.script().count("T.parallel(") >= 3


def test_a_function_without_chains_keeps_a_trace_that_replays_elsewhere():
    """A stage's compile-time variant is a trace replayed inside its merged kernel (schedule/variants.py): the
    search for chains must not enter it (a GetChildBlocks of the root finds other blocks there, the replay
    fails and the stage silently loses its variant: ResNet-18 13.4 -> 16.8 ms)."""
    x, w = te.placeholder((64, 256), name="x"), te.placeholder((256, 128), name="w")
    r = te.reduce_axis((0, 256), "r")
    y = te.compute((64, 128), lambda i, j: te.sum(x[i, r] * w[r, j], axis=r), name="y")
    sch = s_tir.Schedule(te.create_prim_func([x, w, y]))
    schedule_blocks(sch, ["y"])
    assert "GetChildBlocks" not in [inst.kind.name for inst in sch.trace.insts]
