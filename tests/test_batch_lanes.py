"""te_passes/batch_lanes.py: window attention over ragged 7 x 7 windows with (window, head) pairs in lanes."""

import dataclasses

import numpy as np
from tvm import te

from models import swin
from souffle_py.frontend import import_onnx
from souffle_py.schedule.blocks import vector_lanes
from souffle_py.schedule.default import schedule_cpu
from te_passes.batch_lanes import batches_in_lanes
from te_passes.check import assert_same_outputs
from souffle_py.ir.graph import isolate
from te_passes.layout import transpose_operands
from souffle_py.passes import transformed
from tests.onnx_cases import assert_matches_ort

VECTOR = vector_lanes()  # the host's: what a test outside cpu_target.using compiles for

# 14 x 14 tokens in four 7 x 7 windows (49 columns: no vector divides them); the second block is shifted
# and masked. Four heads: 16 (window, head) pairs.
CONFIG = dataclasses.replace(swin.TINY, image_size=56, embed_dim=32, depths=(2,), num_heads=(4,), window_size=7)


def _prepared(config=CONFIG):
    program, _ = transformed(import_onnx(swin.build(config)))
    return transpose_operands(program)


def _feeds(program):
    return program.random_feeds(seed=3)


def _lane_ops(program):
    return {op.name: [int(d) for d in op.output(0).shape] for op in program.stages if op.name.endswith("_lanes")}


def test_attention_chain_computes_pairs_in_lanes():
    program = _prepared()
    lanes = batches_in_lanes(program, VECTOR)
    shapes = _lane_ops(lanes)
    pairs = 4 * 4 // VECTOR
    for block in ("block0", "block1"):
        prefix = f"stage0_{block}_attn_"
        assert shapes[f"{prefix}scores_lanes"] == [pairs, 49, 49, VECTOR]
        assert shapes[f"{prefix}softmax_max_lanes"] == [pairs, 49, 1, VECTOR]
        assert shapes[f"{prefix}softmax_softmax_lanes"] == [pairs, 49, 49, VECTOR]
        assert shapes[f"{prefix}scores_operand_t_lanes"] == [pairs, 8, 49, VECTOR]  # K^T: head dim 8
        # the context GEMM's columns (head dim 8) are ragged too where no 8-lane vector exists: then it is a
        # batched matmul in lanes of its own, else it reads the softmax through the new layout
        assert (f"{prefix}context_lanes" in shapes) == (8 % VECTOR != 0)
    # the context GEMM in lanes reads V, from outside the chain, through a copy in lanes: read in place,
    # each lane of a vector would come from another window and head (MobileViT's P.V: 2.8 GFLOP/s)
    copies = [op for op in lanes.stages if "_context_operand" in op.name]
    assert len(copies) == (2 if 8 % VECTOR else 0)
    assert all([int(d) for d in op.output(0).shape] == [pairs, 49, 8, VECTOR] for op in copies)
    for op in lanes.stages:
        if op.name.endswith("context_lanes"):
            assert all(int(t.shape[-1]) == VECTOR for t in op.input_tensors), op.name
    assert len(lanes.stages) == len(program.stages) + len(copies)  # stored differently, V's copies added
    assert_same_outputs(program, lanes, feeds=_feeds(program), rtol=1e-5, atol=1e-5)


def test_scores_and_softmax_schedules_vectorize_over_pairs():
    lanes = batches_in_lanes(_prepared(), VECTOR)
    ops = {op.name: op for op in lanes.stages}
    for name in ("stage0_block1_attn_scores_lanes", "stage0_block1_attn_softmax_max_lanes",
                 "stage0_block1_attn_softmax_expsum_lanes"):
        text = schedule_cpu(te.create_prim_func([t for part in isolate(ops[name]) for t in part])).script()
        assert f"T.vectorized({VECTOR})" in text, name


def test_pairs_that_fill_no_vector_keep_their_layout():
    """One head over four windows: 4 pairs, no whole vector of them."""
    program = _prepared(dataclasses.replace(CONFIG, num_heads=(1,)))
    assert batches_in_lanes(program, VECTOR) is program


def test_whole_vector_rows_keep_their_layout():
    """4 x 4 windows and 16-wide heads: rows of 16 columns, which the default GEMM and softmax vectorize."""
    program = _prepared(dataclasses.replace(CONFIG, image_size=64, window_size=4, embed_dim=64))
    if 16 % VECTOR == 0:
        assert batches_in_lanes(program, VECTOR) is program


def test_compiled_attention_matches_onnx_runtime():
    model = swin.build(CONFIG)
    feeds = {"image": np.random.default_rng(1).standard_normal((1, 3, 56, 56)).astype(np.float32)}
    inputs = [i.name for i in model.graph.input]
    assert_matches_ort(model, {inputs[0]: feeds["image"]})


def test_a_matmul_sharing_one_weight_across_pairs_stays_a_gemm():
    """EdgeNeXt's MLP multiplies [1, 16, 16, 352] maps by one [352, 88] weight: 88 columns no vector
    divides, but with the same weight for every (batch, row) pair it is one GEMM over 256 rows, not a
    batched matmul to run 16 rows to the vector (48 GFLOP/s)."""
    from models.common import GraphBuilder

    b = GraphBuilder("shared_weight", seed=0, opset=17)
    x = b.input("x", [1, 16, 16, 352])
    w = b.const("w", b.rng.standard_normal((352, 88)).astype(np.float32) / 20)
    b.output(b.node("Relu", [b.node("MatMul", [x, w])]), [1, 16, 16, 88])
    model = b.model()
    program, _ = transformed(import_onnx(model))
    assert _lane_ops(batches_in_lanes(program, VECTOR)) == {}
    feeds = {"x": np.random.default_rng(5).standard_normal((1, 16, 16, 352)).astype(np.float32)}
    assert_matches_ort(model, feeds)
