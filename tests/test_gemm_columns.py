"""te_passes/gemm_columns.py: GEMM columns that the weight panel does not divide, computed padded."""

import numpy as np

from models.common import GraphBuilder
from souffle_py.frontend import import_onnx
from te_passes.check import assert_same_outputs
from te_passes.gemm_columns import pad_gemm_columns
from te_passes.layout import pack_weights
from souffle_py.passes import transformed
from tests.onnx_cases import assert_matches_ort

PANEL = 32


def _mlp(hidden: int, out: int, output_gemm: bool = False):
    """EdgeNeXt's MLP over [1, 8, 8, C] maps: fc1 (C -> hidden), GELU-free ReLU, fc2 (hidden -> out) and a
    bias, the block's output a residual add (or the fc2 GEMM itself, `output_gemm`)."""
    b = GraphBuilder("mlp", seed=0, opset=17)
    x = b.input("x", [1, 8, 8, out])
    w1 = b.const("w1", (b.rng.standard_normal((out, hidden)) / np.sqrt(out)).astype(np.float32))
    w2 = b.const("w2", (b.rng.standard_normal((hidden, out)) / np.sqrt(hidden)).astype(np.float32))
    y = b.node("MatMul", [b.node("Relu", [b.node("MatMul", [x, w1])]), w2])
    if not output_gemm:
        y = b.node("Add", [x, b.node("Add", [y, b.const("b2", np.linspace(-1, 1, out).astype(np.float32))])])
    b.output(y, [1, 8, 8, out])
    feeds = {"x": np.random.default_rng(1).standard_normal((1, 8, 8, out)).astype(np.float32)}
    return b.model(), feeds


def _padded(program):
    return {op.name: [int(d) for d in op.output(0).shape] for op in program.stages if op.name.endswith("_cols")}


def test_ragged_columns_are_computed_as_whole_panels_and_packed():
    model, feeds = _mlp(352, 88)
    program, _ = transformed(import_onnx(model))
    padded = pad_gemm_columns(program, PANEL)
    shapes = _padded(padded)
    assert list(shapes.values()) == [[1, 8, 8, 96]], shapes  # fc2; fc1's 352 columns are 11 panels
    packed = pack_weights(padded, PANEL)
    gemm = next(op for op in packed.stages if op.name.endswith("_cols"))
    weights = [t for t in gemm.input_tensors if packed.placeholder_kind(t) == "param"]
    assert [[int(d) for d in t.shape] for t in weights] == [[3, 352, PANEL]]  # panels, zero past column 88
    assert_same_outputs(program, packed, feeds=feeds, rtol=1e-5, atol=1e-5)
    assert_matches_ort(model, feeds)


def test_output_gemms_and_costly_padding_keep_their_columns():
    model, _ = _mlp(352, 88, output_gemm=True)  # the model's output keeps its shape
    program, _ = transformed(import_onnx(model))
    assert _padded(pad_gemm_columns(program, PANEL)) == {}
    model, _ = _mlp(128, 40)  # 40 -> 64 columns: 60% more work
    program, _ = transformed(import_onnx(model))
    assert _padded(pad_gemm_columns(program, PANEL)) == {}


def test_a_computed_operand_is_read_through_a_zero_padded_copy():
    """Attention over 120 tokens: Q.K^T's 120 columns are K's rows, a computed tensor, read through a copy
    padded with zero rows to 128, so the scores compute whole panels; the softmax reads the first 120."""
    b = GraphBuilder("attention", seed=0, opset=17)
    x = b.input("x", [1, 120, 32])
    q, k, v = (b.node("MatMul", [x, b.const(f"w{n}", (b.rng.standard_normal((32, 32)) / 6).astype(np.float32))])
               for n in "qkv")
    scores = b.node("MatMul", [q, b.node("Transpose", [k], perm=[0, 2, 1])])
    b.output(b.node("MatMul", [b.node("Softmax", [scores], axis=-1), v]), [1, 120, 32])
    model = b.model()
    program, _ = transformed(import_onnx(model))
    padded = pad_gemm_columns(program, PANEL)
    assert [1, 120, 128] in _padded(padded).values(), _padded(padded)
    feeds = {"x": np.random.default_rng(2).standard_normal((1, 120, 32)).astype(np.float32)}
    assert_same_outputs(program, padded, feeds=feeds, rtol=1e-5, atol=1e-5)
    assert_matches_ort(model, feeds)
