"""Dynamic dimensions (souffle_py/dynamic.py, dynamic_spec.py): one DynamicModel runs every shape in its ranges,
each compiled exactly on first use, against ONNX Runtime; shapes outside the ranges and malformed specs are
errors naming what is wrong; export/load keeps every shape; concurrent callers at new shapes compile each once.

Models: the tiny BERT with symbolic batch and sequence (models/dynamic.py), a GPT-2-style block (causal
attention sliced from a mask buffer by the sequence length, tanh-GELU MLP) exported by torch.onnx.export
(classic, and dynamo where onnxscript is installed), and a two-input elementwise model sharing its symbols.
Tolerance: float32, rtol 1e-4, atol 1e-5 (outputs are O(1)); NaN where ONNX Runtime has NaN.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import tarfile
import threading

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import souffle_py
from models.dynamic import symbolic
from souffle_py import DynamicModel, DynamicShapeError, InputError
from souffle_py.baselines import OnnxRuntimeModel
from souffle_py.cli import main


def _check(model, reference, shape, seed=1):
    feeds = model.random_feeds(seed, shape)
    ours, expected = model.run(feeds), reference.run(feeds)
    for name, value in expected.items():
        assert ours[name].shape == value.shape
        np.testing.assert_allclose(ours[name], value, rtol=1e-4, atol=1e-5, equal_nan=True)


@pytest.fixture(scope="module")
def bert():
    return symbolic("bert", tiny=True)


@pytest.fixture(scope="module")
def bert_model(bert):
    return souffle_py.optimize(bert, dynamic={"batch": (1, 3), "hidden_states": {1: (1, 24)}})


def _pair(batch="batch", sequence="sequence") -> onnx.ModelProto:
    """y = a * b + a over [batch, sequence, 8]: two inputs sharing both symbols."""
    dims = [batch, sequence, 8]
    graph = helper.make_graph(
        [helper.make_node("Mul", ["a", "b"], ["ab"]), helper.make_node("Add", ["ab", "a"], ["y"])], "pair",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, dims),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, dims)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, dims)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def test_bert_at_many_lengths_matches_onnxruntime(bert, bert_model):
    assert isinstance(bert_model, DynamicModel)
    assert bert_model.specialised_shapes == [{"batch": 1, "sequence": 1}]  # precompile: the smallest
    reference = OnnxRuntimeModel(bert, threads=1)
    for shape in ({"batch": 1, "sequence": 1}, {"batch": 1, "sequence": 7}, {"batch": 2, "sequence": 13},
                  {"batch": 3, "sequence": 24}):
        _check(bert_model, reference, shape)
    assert len(bert_model.specialised_shapes) == 4
    text = bert_model.describe()
    assert "batch 1..3 x sequence 1..24 (72 shapes)" in text and "4 of 72 shapes specialised" in text
    assert "no generic fallback" in text
    assert "kernel calls" in bert_model.describe({"batch": 2, "sequence": 13})


def test_out_of_range_and_mismatched_shapes_are_input_errors(bert_model):
    with pytest.raises(InputError, match=r"'hidden_states' axis 1 \('sequence'\) is 25, outside the range 1..24"):
        bert_model.run({"hidden_states": np.zeros((1, 25, 64), np.float32)})
    with pytest.raises(InputError, match=r"axis 0 \('batch'\) is 4, outside the range 1..3"):
        bert_model.run({"hidden_states": np.zeros((4, 2, 64), np.float32)})
    with pytest.raises(InputError, match="axis 2 must be 64"):
        bert_model.run({"hidden_states": np.zeros((1, 2, 65), np.float32)})
    with pytest.raises(InputError, match="rank 2"):
        bert_model.run({"hidden_states": np.zeros((1, 2), np.float32)})
    with pytest.raises(InputError, match="dtype"):
        bert_model.run({"hidden_states": np.zeros((1, 1, 64), np.float64)})
    with pytest.raises(InputError, match="missing input"):
        bert_model.run({})


def test_export_and_load_keep_every_shape(bert, bert_model, tmp_path):
    path = tmp_path / "bert-dynamic.tar"
    bert_model.export(path)
    loaded = souffle_py.load(path)
    assert isinstance(loaded, DynamicModel)
    assert loaded.specialised_shapes == bert_model.specialised_shapes
    for shape in bert_model.specialised_shapes:
        feeds = bert_model.random_feeds(3, shape)
        np.testing.assert_array_equal(loaded.run(feeds)["output"], bert_model.run(feeds)["output"])
    assert "read from the exported file" in loaded.describe()
    # a shape the file lacks is compiled here (the compiler is installed)
    _check(loaded, OnnxRuntimeModel(bert, threads=1), {"batch": 2, "sequence": 2})
    # the shapes' equal weights are one array (held, uploaded and exported once)
    arrays = [v for s in bert_model.specialised_shapes for v in bert_model.specialise(s).params.values()]
    assert len({id(v) for v in arrays}) < len(arrays) / 2
    with tarfile.open(path) as archive:
        manifest = json.load(archive.extractfile("dynamic.json"))
    stored = {w for shape in manifest["shapes"] for w in shape["params"].values()}
    assert len(stored) == len({id(v) for v in arrays})
    with pytest.raises(souffle_py.ExportError, match="dynamic"):
        souffle_py.runtime.load(path)


def test_a_damaged_dynamic_export_is_refused(bert_model, tmp_path):
    path = tmp_path / "damaged.tar"
    bert_model.export(path)
    data = bytearray(path.read_bytes())
    start = data.find(b"\x93NUMPY")  # inside weights.npz
    data[start + 200] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(souffle_py.ExportError, match="damaged"):
        souffle_py.load(path)


def test_two_threads_at_two_new_shapes_compile_each_once(caplog):
    model = souffle_py.optimize(_pair(), dynamic={"batch": (1, 4), "sequence": (1, 64)}, precompile="none")
    compiles = []
    compiler = model._compiler

    def counting(proto, **options):
        compiles.append(options["input_shapes"]["a"])
        return compiler(proto, **options)

    model._compiler = counting
    start, errors = threading.Barrier(4), []

    def work(shape):
        try:
            start.wait()
            for seed in range(3):
                feeds = model.random_feeds(seed, shape)
                np.testing.assert_allclose(model.run(feeds)["y"], feeds["a"] * feeds["b"] + feeds["a"], rtol=1e-6,
                                           atol=1e-6)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    shapes = [{"batch": 2, "sequence": 5}, {"batch": 3, "sequence": 17}]
    with caplog.at_level(logging.INFO, logger="souffle_py"):
        threads = [threading.Thread(target=work, args=(shapes[i % 2],)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors
    assert sorted(compiles) == [(2, 5, 8), (3, 17, 8)]
    assert "compiling a[0]=2 (batch), a[1]=5 (sequence) ..." in caplog.text


def test_warm_in_the_background_while_serving():
    model = souffle_py.optimize(_pair(), dynamic={"batch": (1, 4), "sequence": (1, 64)})
    thread = model.warm([{"batch": 4, "sequence": 64}, {"batch": 2, "sequence": 3}], background=True)
    feeds = model.random_feeds(0, {"batch": 1, "sequence": 1})
    np.testing.assert_allclose(model.run(feeds)["y"], feeds["a"] * feeds["b"] + feeds["a"], rtol=1e-6, atol=1e-6)
    thread.join()
    assert model.specialised_shapes == [{"batch": 1, "sequence": 1}, {"batch": 4, "sequence": 64},
                                        {"batch": 2, "sequence": 3}]


def test_the_onnxruntime_fallback_serves_a_new_shape_while_it_compiles():
    model = souffle_py.optimize(_pair(), dynamic={"batch": (1, 4), "sequence": (1, 64)}, precompile="none",
                                fallback="onnxruntime")
    release, compiler = threading.Event(), model._compiler

    def slow(proto, **options):
        if options["input_shapes"]["a"][0] == 3:
            raise RuntimeError("no kernels today")
        assert release.wait(60)
        return compiler(proto, **options)

    model._compiler = slow
    feeds = model.random_feeds(0, {"batch": 2, "sequence": 5})
    expected = feeds["a"] * feeds["b"] + feeds["a"]
    np.testing.assert_allclose(model.run(feeds)["y"], expected, rtol=1e-6, atol=1e-6)  # ONNX Runtime, at once
    assert "1 calls served by it so far, 1 shapes compiling now" in model.describe()
    assert model.specialised_shapes == []
    release.set()
    assert model.wait(60)
    assert model.specialised_shapes == [{"batch": 2, "sequence": 5}]
    out = {"y": np.empty_like(expected)}
    model.run(feeds, out=out)  # souffle-py's kernels now
    np.testing.assert_allclose(out["y"], expected, rtol=1e-6, atol=1e-6)
    assert "1 calls served by it so far" in model.describe()
    failing = model.random_feeds(0, {"batch": 3, "sequence": 2})  # a compile that fails: the fallback serves on
    for _ in range(2):
        np.testing.assert_allclose(model.run(failing)["y"], failing["a"] * failing["b"] + failing["a"], rtol=1e-6,
                                   atol=1e-6)
        model.wait(60)
    assert "batch=3, sequence=2: compile failed (RuntimeError: no kernels today)" in model.describe()
    with pytest.raises(InputError, match="fallback must be one of"):
        souffle_py.optimize(_pair(), dynamic={"batch": (1, 4), "sequence": (1, 64)}, fallback="relax")


def test_max_shapes_drops_the_least_recently_used():
    model = souffle_py.optimize(_pair(), dynamic={"batch": (1, 4), "sequence": (1, 64)}, precompile="none")
    model.max_shapes = 2
    shapes = [{"batch": 1, "sequence": 2}, {"batch": 1, "sequence": 3}, {"batch": 1, "sequence": 4}]
    feeds = [model.random_feeds(0, shape) for shape in shapes]
    model.run(feeds[0])
    model.run(feeds[1])
    model.run(feeds[0])  # the second is now the least recently used
    model.run(feeds[2])
    assert model.specialised_shapes == [shapes[0], shapes[2]] and model.dropped == 1
    np.testing.assert_allclose(model.run(feeds[1])["y"], feeds[1]["a"] * feeds[1]["b"] + feeds[1]["a"], rtol=1e-6,
                               atol=1e-6)  # compiled again
    assert len(model.specialised_shapes) == 2 and "2 dropped so far" in model.describe()


def test_unnamed_symbolic_axes_are_symbols_of_their_own(caplog):
    model = souffle_py.optimize(_pair(None, "sequence"), dynamic={"a": {0: (1, 4)}, "b": {0: (1, 4)},
                                                                  "sequence": (1, 8)}, precompile="none")
    assert model.spec.symbols == ["a[0]", "sequence", "b[0]"]
    feeds = {"a": np.full((3, 2, 8), 2, np.float32), "b": np.full((3, 2, 8), 3, np.float32)}
    with caplog.at_level(logging.INFO, logger="souffle_py"):
        np.testing.assert_array_equal(model.run(feeds)["y"], np.full((3, 2, 8), 8, np.float32))
    assert "compiling a[0]=3, a[1]=2 (sequence), b[0]=3 ..." in caplog.text
    with pytest.raises(InputError, match=r"input 'b' axis 0 is 5, outside the range 1..4"):
        model.run({"a": feeds["a"], "b": np.ones((5, 2, 8), np.float32)})


def test_inputs_sharing_a_symbol_must_agree():
    model = souffle_py.optimize(_pair(), dynamic={"a": {0: (1, 4), 1: (1, 64)}})  # covers b's axes too
    a = np.ones((2, 5, 8), np.float32)
    for compiled in (False, True):  # the message names the symbol before and after (2, 5) is compiled
        with pytest.raises(InputError, match="input 'b' axis 1 is 6 but input 'a' axis 1 is 5: both are the "
                                             "symbolic dimension 'sequence'"):
            model.run({"a": a, "b": np.ones((2, 6, 8), np.float32)})
        np.testing.assert_array_equal(model.run({"a": a, "b": a})["y"], 2 * a)


@pytest.mark.parametrize("dynamic,message", [
    ({"c": {0: (1, 4)}}, "'c', which is not an input of the model"),
    ({"batch": (1, 4), "a": {3: (1, 4)}}, "axis 3, but input 'a' has rank 3"),
    ({"batch": (1, 4), "sequence": (1, 8), "a": {2: (1, 8)}}, "input 'a' axis 2 is fixed to 8"),
    ({"batch": (4, 1), "sequence": (1, 8)}, r"min 4 > max 1"),
    ({"batch": (0, 4), "sequence": (1, 8)}, "positive integers"),
    ({"batch": (1, 4), "seq": (1, 8)}, "'seq', which is neither an input .* nor a symbolic dimension"),
    ({"batch": (1, 4)}, r"input 'a' axis 1 is symbolic \('sequence'\) but dynamic gives it no range"),
    ({"batch": (1, 4), "sequence": (1, 8), "b": {1: (1, 9)}}, "conflicts with 1..8"),
    ({"a": (1, 4)}, "must map axes to ranges"),
    ({}, "non-empty dict"),
])
def test_bad_specs_name_what_is_wrong(dynamic, message):
    with pytest.raises(DynamicShapeError, match=message):
        souffle_py.optimize(_pair(), dynamic=dynamic)


def test_bad_options_with_dynamic():
    spec = {"batch": (1, 4), "sequence": (1, 8)}
    with pytest.raises(InputError, match="not both"):
        souffle_py.optimize(_pair(), dynamic=spec, input_shapes={"a": (1, 1, 8)})
    with pytest.raises(InputError, match="outside its range"):
        souffle_py.optimize(_pair(), dynamic=spec, precompile={"batch": 5, "sequence": 1})
    with pytest.raises(InputError, match="give dynamic"):
        souffle_py.optimize(_pair(1, 1), precompile="max")
    model = souffle_py.optimize(_pair(), dynamic=spec, precompile="none")
    assert model.specialised_shapes == []
    with pytest.raises(InputError, match="outside its range"):
        model.specialise({"batch": 1, "sequence": 9})


def test_a_second_optimize_finds_the_shapes_in_the_compile_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SOUFFLE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("SOUFFLE_COMPILE_CACHE", "1")
    spec = {"batch": (1, 4), "sequence": (1, 8)}
    first = souffle_py.optimize(_pair(), dynamic=spec, precompile=["min", "max"])
    assert not first.cached
    second = souffle_py.optimize(_pair(), dynamic=spec, precompile=["max", {"batch": 1, "sequence": 1}])
    assert second.cached and all(second.specialise(s).cached for s in second.specialised_shapes)


def test_shapes_loaded_from_the_cache_hold_no_other_export_alive(bert, tmp_path, monkeypatch):
    """A shape loaded from the compile cache has its weights as views of its export's params buffer: each one
    is the first shape's array or a copy of its own, so no later export's buffer stays alive (BERT-base
    held 0.43 GB more per shape)."""
    monkeypatch.setenv("SOUFFLE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("SOUFFLE_COMPILE_CACHE", "1")
    spec = {"batch": (1, 2), "sequence": (1, 16)}
    shapes = [{"batch": 1, "sequence": 5}, {"batch": 2, "sequence": 9}]
    souffle_py.optimize(bert, dynamic=spec, precompile=shapes, quiet=True)
    model = souffle_py.optimize(bert, dynamic=spec, precompile=shapes, quiet=True)
    first, later = (model.specialise(shape) for shape in shapes)
    assert first.cached and later.cached
    shared = {id(a) for a in first.params.values()}
    own = [name for name, a in later.params.items() if id(a) not in shared]
    assert own, "the tiny BERT has shape-dependent constants (position embeddings)"
    assert all(later.params[name].base is None for name in own), own


def test_a_new_process_loads_the_shapes_without_importing_the_compiler(tmp_path, monkeypatch):
    monkeypatch.setenv("SOUFFLE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("SOUFFLE_COMPILE_CACHE", "1")
    model = tmp_path / "pair.onnx"
    onnx.save(_pair(), model)
    spec = {"batch": (1, 4), "sequence": (1, 8)}
    souffle_py.optimize(model, dynamic=spec, precompile=["min", "max"], quiet=True)
    code = ("import sys, numpy as np, souffle_py; "
            f"m = souffle_py.optimize({str(model)!r}, dynamic={spec!r}, precompile=['min', 'max'], quiet=True); "
            "a = np.ones((4, 8, 8), np.float32); y = m.run({'a': a, 'b': a})['y']; "
            "print(m.cached, bool((y == 2).all()), 'tvm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "SOUFFLE_CACHE": str(tmp_path / "cache")})
    assert out.stdout.strip() == "True True False", out.stderr[-2000:]


def test_cli_compile_dynamic(tmp_path, capsys):
    model = tmp_path / "pair.onnx"
    onnx.save(_pair(), model)
    out = tmp_path / "pair.tar"
    assert main(["compile", str(model), "--dynamic", "a:0=1..4", "--dynamic", "sequence=1..16",
                 "--precompile", "batch=2,sequence=3", "-o", str(out), "--no-cache", "--fallback", "onnxruntime",
                 "--benchmark"]) == 0
    text = capsys.readouterr().out
    assert "1 of 64 shapes specialised" in text and "batch=2, sequence=3" in text
    assert "latency at batch=2, sequence=3:" in text
    loaded = souffle_py.load(out)
    assert loaded.specialised_shapes == [{"batch": 2, "sequence": 3}] and loaded.fallback == "onnxruntime"
    assert main(["compile", str(model), "--dynamic", "sequence=5..1"]) == 2
    assert "min 5 > max 1" in capsys.readouterr().err
    assert main(["compile", str(model), "--dynamic", "sequence"]) == 2


# --- a GPT-2-style block exported by torch -----------------------------------------------------------------------

def _gpt2_block():
    torch = pytest.importorskip("torch")

    class Block(torch.nn.Module):
        def __init__(self, d=32, heads=4, context=64):
            super().__init__()
            self.heads = heads
            self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
            self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
            self.fc, self.out = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
            self.register_buffer("bias", torch.tril(torch.ones(context, context)).view(1, 1, context, context))

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
            q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = torch.softmax(att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf")), dim=-1)
            x = x + self.proj((att @ v).transpose(1, 2).contiguous().view(b, t, c))
            m = self.fc(self.ln2(x))
            m = 0.5 * m * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (m + 0.044715 * torch.pow(m, 3.0))))
            return x + self.out(m)

    torch.manual_seed(0)
    return torch, Block().eval()


@pytest.mark.parametrize("exporter", ["classic", "dynamo"])
def test_gpt2_block_export_at_many_lengths(exporter, tmp_path):
    torch, block = _gpt2_block()
    path = tmp_path / f"gpt2-{exporter}.onnx"
    example = (torch.randn(2, 8, 32),)
    if exporter == "classic":
        axes = {0: "batch", 1: "sequence"}
        torch.onnx.export(block, example, str(path), input_names=["x"], output_names=["y"], opset_version=17,
                          dynamic_axes={"x": axes, "y": axes}, dynamo=False)
    else:
        pytest.importorskip("onnxscript")
        dims = {0: torch.export.Dim("batch", min=1, max=8), 1: torch.export.Dim("sequence", min=1, max=64)}
        torch.onnx.export(block, example, str(path), input_names=["x"], output_names=["y"],
                          dynamic_shapes={"x": dims}, dynamo=True, verbose=False)
    inputs = onnx.load(path).graph.input
    assert [d.dim_param for d in inputs[0].type.tensor_type.shape.dim][:2] == ["batch", "sequence"]
    model = souffle_py.optimize(path, dynamic={"batch": (1, 4), "sequence": (1, 64)}, precompile="none")
    reference = OnnxRuntimeModel(path, threads=1)
    for batch, sequence in ((1, 1), (2, 11), (4, 64)):
        _check(model, reference, {"batch": batch, "sequence": sequence})
