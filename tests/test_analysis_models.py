"""The analysis on the tiny BERT and LSTM, through the ONNX frontend, and the `souffle analyze` command.

Expectations are derived from the ONNX graphs (op types, which MatMuls share an input), not from TE names.
"""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from models import lstm
from models.registry import build_model
from souffle_py import cli
from souffle_py.frontend import import_onnx
from souffle_py.ir.analysis import (DATA_DEPENDENT, ONE_RELIES_ON_MANY, ONE_RELIES_ON_ONE, ONE_TO_MANY, ONE_TO_ONE,
                                analyze, maps_equal, summary)

DEPENDENCES = {ONE_RELIES_ON_ONE, ONE_RELIES_ON_MANY, DATA_DEPENDENT}
ACCESS_KINDS = {ONE_TO_ONE, ONE_TO_MANY, DATA_DEPENDENT}


def check_everything_classified(analysis):
    for te_info in analysis.tes.values():
        assert te_info.klass in {"CI", "MI"} and te_info.dependence in DEPENDENCES, te_info.name
        assert te_info.accesses and all(a.kind in ACCESS_KINDS and a.text for a in te_info.accesses), te_info.name
    assert any(a.M is not None for t in analysis.tes.values() for a in t.accesses)


def tes_of(analysis, node_names):
    return {t.name for t in analysis.tes.values() if t.origin in node_names}


@pytest.mark.parametrize("layernorm", ["primitive", "op"])
def test_tiny_bert(layernorm):
    model = build_model("bert", tiny=True, layernorm=layernorm)
    analysis = analyze(import_onnx(model))
    check_everything_classified(analysis)
    op_type = {n.name: n.op_type for n in model.graph.node}
    for te_info in analysis.tes.values():  # GEMMs and batch matmuls CI; softmax, LayerNorm, elementwise MI
        assert te_info.klass == ("CI" if op_type[te_info.origin] == "MatMul" else "MI"), te_info.name

    # Q/K/V: the MatMuls that share their input are one spatial-reuse set of independent readers.
    by_input = defaultdict(list)
    for node in model.graph.node:
        if node.op_type == "MatMul":
            by_input[node.input[0]].append(node.name)
    qkv_groups = [names for names in by_input.values() if len(names) == 3]
    assert len(qkv_groups) == 2  # one per layer
    text = summary(analysis)
    for names in qkv_groups:
        readers = tes_of(analysis, names)
        reuse = next(s for s in analysis.spatial_reuse if set(s.independent) == readers)
        assert all(analysis.tes[r].access(reuse.tensor).kind == ONE_TO_MANY for r in readers)
        assert f"{reuse.tensor} (" in text and all(r in text for r in readers)


def test_tiny_bert_dependences():
    model = build_model("bert", tiny=True)
    analysis = analyze(import_onnx(model))
    scores = next(iter(tes_of(analysis, ["layer0/attn/scores"])))
    # A score (head h, query s, key t) depends on the hidden states of tokens s and t.
    assert maps_equal(analysis.dependence(scores, "hidden_states"),
                      f"{{ {scores}[0, h, s, t] -> hidden_states[0, r, c] : 0 <= h < 4 and 0 <= s < 16 "
                      "and 0 <= t < 16 and 0 <= c < 64 and (r = s or r = t) }")
    # Attention mixes the sequence: every output element depends on every input element.
    assert maps_equal(analysis.dependence("output", "hidden_states"),
                      "{ output[0, s, j] -> hidden_states[0, r, c] : 0 <= s, r < 16 and 0 <= j, c < 64 }")


def test_tiny_lstm_op():
    config = lstm.TINY
    model = build_model("lstm", tiny=True)
    analysis = analyze(import_onnx(model))
    check_everything_classified(analysis)
    ci = [t for t in analysis.tes.values() if t.klass == "CI"]
    # Per layer: the input projection of all steps and the recurrent GEMV (over all steps: a recurrence).
    assert len(ci) == config.layers * 2 and all(t.contraction for t in ci)
    # Each layer's hidden and cell state carry the step's output to the next step.
    assert len(analysis.back_edges) == 2 * config.layers
    for state, source in analysis.back_edges.items():
        assert analysis.tensors[state].shape == analysis.tensors[source].shape == (config.steps, 1, config.hidden)
        assert maps_equal(analysis.state_map(state),
                          f"{{ {state}[t, 0, j] -> {source}[t - 1, 0, j] : 1 <= t < {config.steps} "
                          f"and 0 <= j < {config.hidden} }}")
    text = summary(analysis)
    assert "recurrences: 4 states" in text
    # the recurrent weights are read again at every step: the reuse the time loop keeps in cache
    assert f"every step reads layer0_R_T (4.0 KiB): {config.steps - 1} re-reads" in text
    # Through the back edges, step t of a layer's hidden state depends on its input steps 0..t only.
    assert maps_equal(analysis.dependence("output", "x"),
                      f"{{ output[t, 0, j] -> x[s, 0, k] : 0 <= s <= t < {config.steps} "
                      f"and 0 <= j < {config.hidden} and 0 <= k < {config.input} }}")


def test_tiny_lstm_unrolled():
    config = lstm.TINY
    model = build_model("lstm", tiny=True, spelling="unrolled")
    analysis = analyze(import_onnx(model))
    check_everything_classified(analysis)
    op_type = {n.name: n.op_type for n in model.graph.node}
    for te_info in analysis.tes.values():
        assert te_info.klass == ("CI" if op_type[te_info.origin] == "MatMul" else "MI"), te_info.name
    recurrent = {n.input[1] for n in model.graph.node if n.op_type == "MatMul" and "h_matmul" in n.name}
    temporal = [t for t in analysis.temporal_reuse if t.kind == "param" and t.rereads == config.steps - 2]
    assert len(temporal) == len(recurrent) == config.layers
    # The input projections of the steps are independent: their weight is spatial reuse.
    assert sum(len(s.independent) == config.steps for s in analysis.spatial_reuse
               if analysis.tensors[s.tensor].kind == "param") == config.layers


def test_cli_analyze(tmp_path, capsys):
    model = build_model("bert", tiny=True)
    model_path, json_path = tmp_path / "bert.onnx", tmp_path / "analysis.json"
    model_path.write_bytes(model.SerializeToString())
    assert cli.main(["analyze", str(model_path), "--json", str(json_path)]) == 0
    out = capsys.readouterr().out
    count = len(analyze(import_onnx(model)).tes)
    for line in (f"TEs: {count}", "dependence:", "spatial reuse:", "temporal reuse:", "peak live tensors"):
        assert line in out
    data = json.loads(json_path.read_text())
    assert data["summary"]["tes"] == len(data["tes"]) == count
    assert data["summary"]["ci"] + data["summary"]["mi"] == count
    gemm = next(t for t in data["tes"] if t["origin"] == "layer0/attn/q_matmul")
    assert gemm["class"] == "CI" and gemm["dependence"] == ONE_RELIES_ON_MANY
    assert all(a["map"].startswith("{") for t in data["tes"] for a in t["accesses"])
    assert any(a["M"] is not None for t in data["tes"] for a in t["accesses"])
