"""scripts/int8_divergence.py: the first quantized tensors where souffle-py leaves ONNX Runtime."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))

import int8_divergence  # noqa: E402
from int8_models import mlp, quantized  # noqa: E402


def test_a_qdq_mlp_has_no_divergence(tmp_path, capsys):
    path = quantized(mlp(), str(tmp_path), activations="uint8", per_channel=True)
    assert int8_divergence.main([path]) == 0
    out = capsys.readouterr().out
    assert "every quantized tensor equals ONNX Runtime's" in out


def test_the_first_differing_tensors_are_listed_in_graph_order_with_their_source(tmp_path):
    model, names = int8_divergence.probe_model(onnx.load(quantized(mlp(), str(tmp_path))))
    assert len(names) >= 3 and {o.name for o in model.graph.output} >= set(names)
    plain = {n: np.zeros(8, np.int8) for n in names}
    ours = dict(plain)
    ours[names[1]] = np.array([0, 1, 0, 0, 0, 0, 0, -2], np.int8)  # two values off, by 1 and 2 steps
    ours[names[2]] = np.ones(8, np.int8)
    lines = int8_divergence.compare(model, names, ours, plain, plain, first=1)
    assert len(lines) == 1 and lines[0].startswith(f"{names[1]}: 2 of 8 values differ, at most 2 step(s)")
    assert "ONNX Runtime fused vs unfused: 0 differ" in lines[0]
