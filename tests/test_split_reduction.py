"""Split-K of long reductions (te_passes/split_reduction.py) and the CUDA backend's choice of which to split
(backends/cuda/split_k.py): same values, the partial's layout, and the decisions on BERT-base's shapes."""

import numpy as np
import pytest
from tvm import te, topi

from souffle_py.backends.cuda.split_k import split_for
from souffle_py.partition import H100
from souffle_py.ir.program import TEProgram
from te_passes.check import assert_same_outputs
from souffle_py.ir.marks import MEMBER
from te_passes.split_reduction import Split, split_reductions, splittable


def _program(build) -> TEProgram:
    x = te.placeholder((16, 100), "float32", name="x")
    w = te.placeholder((100, 32), "float32", name="w")
    out = build(x, w)
    rng = np.random.default_rng(0)
    return TEProgram(inputs={"x": x}, params={"w": rng.standard_normal((100, 32)).astype("float32")},
                     param_tensors={"w": w}, outputs={"y": out})


def _gemm_then_max(x, w):
    k = te.reduce_axis((0, 100), name="k")
    gemm = te.compute((16, 32), lambda i, j: te.sum(x[i, k] * w[k, j], axis=k), name="gemm")
    r = te.reduce_axis((0, 32), name="r")
    row_max = te.compute((16,), lambda i: te.max(gemm[i, r], axis=r), name="row_max")
    return te.compute((16, 32), lambda i, j: gemm[i, j] - row_max[i], name="y")


@pytest.mark.parametrize("contiguous", [False, True])
@pytest.mark.parametrize("parts", [2, 8])  # 100 terms in 8 parts: the last chunk is guarded
def test_split_reductions_compute_the_same_values(parts, contiguous):
    program = _program(_gemm_then_max)
    after = split_reductions(program, lambda op: Split(parts, contiguous))
    names = [op.name for op in after.stages]
    assert names == ["gemm_partial", "gemm", "row_max_partial", "row_max", "y"]
    partial = after.stages[0].output(0)
    assert [int(d) for d in partial.shape] == ([parts, 16, 32] if contiguous else [16, 32, parts])
    assert_same_outputs(program, after, rtol=1e-5, atol=1e-5)


def test_reductions_not_chosen_or_not_splittable_are_left_alone():
    program = _program(_gemm_then_max)
    assert split_reductions(program, lambda op: None) is program
    x = te.placeholder((4, 5, 6), "float32", name="x")
    two_axes = topi.sum(x, axis=(1, 2))
    assert not splittable(two_axes.op)


def _gemm(rows, cols, depth, attrs=None):
    a = te.placeholder((rows, depth), "float32", name="a")
    b = te.placeholder((depth, cols), "float32", name="b")
    k = te.reduce_axis((0, depth), name="k")
    return te.compute((rows, cols), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k), name="gemm",
                      attrs=attrs or {}).op


def _row_sum(rows, depth):
    x = te.placeholder((rows, depth), "float32", name="x")
    k = te.reduce_axis((0, depth), name="k")
    return te.compute((rows,), lambda i: te.sum(x[i, k], axis=k), name="mean").op


def test_bert_base_shapes_on_an_h100():
    """Second FFN GEMM: 24 tiles of depth 3072 -> 4 x 24; QKV's 72 tiles fill enough SMs; the attention
    output GEMM's 24 tiles are only 768 deep; layer-norm rows of 768 terms take a warp each in the grid
    kernel (24 terms per lane: nothing to split), as do softmax rows of 128 terms."""
    assert split_for(_gemm(128, 768, 3072), H100) == Split(4, contiguous=True)
    assert split_for(_gemm(128, 2304, 768), H100) is None
    assert split_for(_gemm(128, 768, 768), H100) is None
    assert split_for(_row_sum(128, 768), H100) is None
    assert split_for(_row_sum(1536, 128), H100) is None


def test_recurrence_steps_are_not_split():
    assert split_for(_gemm(128, 768, 3072, attrs={MEMBER: "rnn"}), H100) is None
