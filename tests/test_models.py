"""Tiny BERT and LSTM builders: valid ONNX, runnable in onnxruntime, deterministic, and spellings that agree."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from models import bert, lstm
from models.registry import build_model

REPO = Path(__file__).resolve().parents[1]


def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray], optimize: bool = True) -> np.ndarray:
    """optimize=False runs the graph as written: onnxruntime would otherwise fuse the primitive LayerNorm."""
    options = ort.SessionOptions()
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return sess.run(["output"], feeds)[0]


def bert_input(config: bert.Config) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {"hidden_states": rng.standard_normal((config.batch, config.seq, config.hidden)).astype(np.float32)}


def lstm_input(config: lstm.Config) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {"x": rng.standard_normal((config.steps, config.batch, config.input)).astype(np.float32)}


BERT_CONFIGS = [dataclasses.replace(bert.TINY, layernorm=ln, batch=batch)
                for ln in ("primitive", "op") for batch in (1, 2)]
LSTM_CONFIGS = [dataclasses.replace(lstm.TINY, spelling=sp, batch=batch)
                for sp in ("op", "unrolled") for batch in (1, 3)]


@pytest.mark.parametrize("config", BERT_CONFIGS, ids=str)
def test_bert_builds_and_runs(config):
    model = bert.build(config)
    onnx.checker.check_model(model, full_check=True)
    out = run(model, bert_input(config))
    assert out.shape == (config.batch, config.seq, config.hidden)
    assert np.isfinite(out).all()
    # LayerNorm output with gamma ~ 1, beta ~ 0: unit scale, so 1e-4 relative comparisons mean something.
    assert 0.5 < out.std() < 2.0


@pytest.mark.parametrize("config", LSTM_CONFIGS, ids=str)
def test_lstm_builds_and_runs(config):
    model = lstm.build(config)
    onnx.checker.check_model(model, full_check=True)
    out = run(model, lstm_input(config))
    assert out.shape == (config.steps, config.batch, config.hidden)
    assert np.isfinite(out).all()
    assert np.abs(out).max() < 1.0  # h = o * tanh(c)
    assert out.std() > 1e-2


DETERMINISM_CASES = [(bert, c) for c in BERT_CONFIGS[::2]] + [(lstm, c) for c in LSTM_CONFIGS[::2]]


@pytest.mark.parametrize("module,config", DETERMINISM_CASES, ids=str)
def test_build_is_deterministic(module, config):
    assert module.build(config, seed=3).SerializeToString() == module.build(config, seed=3).SerializeToString()
    assert module.build(config, seed=3).SerializeToString() != module.build(config, seed=4).SerializeToString()


@pytest.mark.parametrize("batch", [1, 3])
def test_lstm_spellings_agree(batch):
    op = dataclasses.replace(lstm.TINY, spelling="op", batch=batch)
    unrolled = dataclasses.replace(op, spelling="unrolled")
    feeds = lstm_input(op)
    a = run(lstm.build(op, seed=5), feeds, optimize=False)
    b = run(lstm.build(unrolled, seed=5), feeds, optimize=False)
    assert np.abs(a - b).max() < 1e-5


def test_lstm_output_depends_on_input():
    """Guards the weight scales: with PyTorch's init the stacked output barely sees the input."""
    config = dataclasses.replace(lstm.TINY, layers=4, steps=8)
    model = lstm.build(config)
    other = {"x": np.random.default_rng(2).standard_normal((8, 1, config.input)).astype(np.float32)}
    assert np.abs(run(model, lstm_input(config)) - run(model, other)).std() > 0.02


def test_lstm_single_step_and_layer():
    config = dataclasses.replace(lstm.TINY, layers=1, steps=1, spelling="unrolled")
    feeds = lstm_input(config)
    ref = run(lstm.build(dataclasses.replace(config, spelling="op")), feeds, optimize=False)
    assert np.abs(run(lstm.build(config), feeds, optimize=False) - ref).max() < 1e-5


def test_bert_layernorm_spellings_agree():
    primitive = dataclasses.replace(bert.TINY, layernorm="primitive")
    op = dataclasses.replace(bert.TINY, layernorm="op")
    feeds = bert_input(primitive)
    a, b = run(bert.build(primitive), feeds, optimize=False), run(bert.build(op), feeds, optimize=False)
    assert np.abs(a - b).max() < 1e-4


def test_bad_config_is_rejected():
    with pytest.raises(ValueError, match="layernorm"):
        bert.build(dataclasses.replace(bert.TINY, layernorm="fused"))
    with pytest.raises(ValueError, match="divisible"):
        bert.build(dataclasses.replace(bert.TINY, heads=3))
    with pytest.raises(ValueError, match="spelling"):
        lstm.build(dataclasses.replace(lstm.TINY, spelling="scan"))


def test_registry_overrides():
    model = build_model("lstm", tiny=True, seed=2, steps=3, spelling="unrolled")
    assert model.SerializeToString() == lstm.build(dataclasses.replace(lstm.TINY, steps=3, spelling="unrolled"),
                                                   seed=2).SerializeToString()
    with pytest.raises(TypeError, match="no config field"):
        build_model("bert", tiny=True, depth=3)


def test_cli_writes_model(tmp_path):
    out = tmp_path / "l.onnx"
    proc = subprocess.run([sys.executable, "-m", "models", "lstm", "--tiny", "--spelling", "unrolled",
                           "--steps", "3", "--seed", "2", "-o", str(out)],
                          cwd=REPO, capture_output=True, text=True, check=True)
    assert str(out) in proc.stdout and "nodes" in proc.stdout
    expected = lstm.build(dataclasses.replace(lstm.TINY, spelling="unrolled", steps=3), seed=2)
    assert onnx.load(str(out)).SerializeToString() == expected.SerializeToString()


@pytest.mark.parametrize("name,flags", [("resnext", ["--depths", "1,1"]), ("mmoe", ["--expert-hidden", "8,8"]),
                                        ("swin", []), ("efficientnet", [])])
def test_cli_builds_every_model_including_tuple_fields(tmp_path, name, flags):
    """Config fields of type tuple[int, ...] are flags taking N,N,...; fields no flag can express are skipped."""
    path = tmp_path / f"{name}.onnx"
    subprocess.run([sys.executable, "-m", "models", name, "--tiny", *flags, "-o", str(path)], check=True,
                   cwd=REPO, capture_output=True)
    assert onnx.load(str(path)).graph.node
