"""schedule/softmax_gemms.py: attention's softmax over data beyond the caches computed under its context
GEMM's row tiles, values unchanged; smaller attention keeps the row chains' and GEMM's own schedules."""

import numpy as np
import pytest
import tvm
from tvm import te

from souffle_py.schedule.default import schedule_cpu
from souffle_py.schedule.row_chains import ROW_CHAIN_MIN_BYTES
from souffle_py.target import resolve_target
from tests.test_row_chains import _softmax

TARGET = resolve_target("llvm")


def _attention(heads, tokens, dim):
    """softmax(S) . V for given scores S [1, heads, tokens, tokens] and values V [1, heads, tokens, dim]."""
    s, y = _softmax((1, heads, tokens, tokens))
    v = te.placeholder((1, heads, tokens, dim), name="v")
    k = te.reduce_axis((0, tokens), "k")
    out = te.compute((1, heads, tokens, dim), lambda b, h, i, j: te.sum(y[b, h, i, k] * v[b, h, k, j], axis=k),
                     name="context")
    return [s, v, out]


def _expected(s, v):
    e = np.exp(s - s.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)) @ v


def _run(func, *values):
    lib = tvm.compile(func, target=TARGET)
    args = [tvm.runtime.tensor(v) for v in values]
    out = tvm.runtime.tensor(np.zeros((*values[0].shape[:-1], values[1].shape[-1]), np.float32))
    lib["main"](*args, out)
    return out.numpy()


@pytest.mark.parametrize("heads, tokens", [(1, 1500), (2, 1001)])  # Whisper's 1500 keys: 15-row tiles; 13
def test_the_probabilities_of_long_attention_stay_in_the_row_tile(heads, tokens):
    assert heads * tokens * tokens * 4 >= ROW_CHAIN_MIN_BYTES
    func = schedule_cpu(te.create_prim_func(_attention(heads, tokens, 32)))
    assert func.script().count("T.parallel(") == 1  # max, sum, probabilities and context under one loop
    rng = np.random.default_rng(0)
    s = (rng.standard_normal((1, heads, tokens, tokens)) * 3).astype(np.float32)
    v = rng.standard_normal((1, heads, tokens, 32)).astype(np.float32)
    np.testing.assert_allclose(_run(func, s, v), _expected(s, v), rtol=1e-4, atol=1e-5)


def test_attention_within_the_caches_keeps_its_own_schedules():
    """BERT-base's 12 x 128 x 128 probabilities (786 KB) stay in L2 between the stages."""
    script = schedule_cpu(te.create_prim_func(_attention(12, 128, 64))).script()
    assert script.count("T.parallel(") >= 4
