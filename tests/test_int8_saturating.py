"""optimize(int8="saturating"): the int8 dot product as vpmaddubsw + vpmaddwd by ones on x86 without VNNI
(schedule/int8_dot.py), the arithmetic of ONNX Runtime's and OpenVINO's AVX2 kernels: each pair of
adjacent u8 x s8 products (depths 2t, 2t + 1 of a quad) summed into an int16 that saturates, then summed
exactly, in the stages whose activations have a low or run-time zero point (which ones:
test_dot_weights.py). "exact" (the default) keeps the two-vpmaddwd form; VNNI targets keep vpdpbusd either
way."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import souffle_py
from souffle_py.cpu_features import host_features
from souffle_py.errors import InputError
from souffle_py.schedule.int8_dot import PAIRS_256, SATURATING_256, SATURATING_NOTE, VPDPBUSD_256, arithmetic, dot4
from souffle_py.cpu_target import CpuTarget

sys.path.insert(0, str(Path(__file__).parent))
from int8_models import IR_VERSION, OPSET, mlp, quantized, random_feeds  # noqa: E402

HASWELL = "llvm -mcpu=haswell"
HOST = host_features() or set()
RUNS_AVX2 = "avx2" in HOST
ORT_SATURATES = RUNS_AVX2 and not {"avx512vnni", "avxvnni"} & HOST  # ONNX Runtime's U8S8 kernels: vpmaddubsw


def _asm(model) -> str:
    module = model._module
    return getattr(module, "mod", module).inspect_source("asm")


def _matmul_integer(weights: np.ndarray) -> onnx.ModelProto:
    """y = MatMulInteger(x uint8 [8, K], weights int8 [K, N]): the int32 sums themselves."""
    rows, (depth, columns) = 8, weights.shape
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["x", "w"], ["y"])], "matmul_integer",
        [helper.make_tensor_value_info("x", TensorProto.UINT8, [rows, depth])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, [rows, columns])],
        [numpy_helper.from_array(weights, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION)


def _saturating_sums(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """vpmaddubsw's arithmetic: pairs of adjacent depths summed into int16 with saturation, then exactly."""
    products = x.astype(np.int32)[:, :, None] * w.astype(np.int32)[None, :, :]  # [rows, K, N]
    pairs = products[:, 0::2] + products[:, 1::2]
    return np.clip(pairs, -32768, 32767).sum(axis=1).astype(np.int32)


def test_the_arithmetic_picks_the_dot_product_only_where_vnni_is_missing():
    avx2, alderlake = CpuTarget.from_target(HASWELL), CpuTarget.from_target("llvm -mcpu=alderlake")
    assert dot4(avx2) is PAIRS_256 and dot4(alderlake) is VPDPBUSD_256
    with arithmetic("saturating"):
        assert dot4(avx2) is SATURATING_256 and dot4(alderlake) is VPDPBUSD_256
        assert not SATURATING_256.split_weights  # vpdpbusd's layout: weights stay int8 quads
    assert dot4(avx2) is PAIRS_256
    with pytest.raises(InputError, match="int8 must be one of exact, saturating"):
        souffle_py.optimize(_matmul_integer(np.zeros((64, 16), np.int8)), target=HASWELL, int8="fast")


def test_saturating_sums_are_vpmaddubsw_pairs_and_exact_sums_are_not(tmp_path):
    """Weights and inputs at the extremes: many pairs pass 32767, so the two arithmetics differ; each equals
    its numpy model (run where the host has AVX2; the assembly is checked anywhere)."""
    rng = np.random.default_rng(0)
    weights = rng.choice(np.array([-128, -127, 127, 100, -3, 0], np.int8), size=(64, 32))
    model = _matmul_integer(weights)
    saturating = souffle_py.optimize(model, target=HASWELL, int8="saturating", quiet=True, cache=False)
    exact = souffle_py.optimize(model, target=HASWELL, quiet=True, cache=False)
    assert "vpmaddubsw" in _asm(saturating) and "vpmaddubsw" not in _asm(exact)
    assert SATURATING_NOTE in saturating.plan.notes and SATURATING_NOTE not in exact.plan.notes  # describe() says so
    assert SATURATING_NOTE in saturating.describe()
    if not RUNS_AVX2:
        pytest.skip("the host has no AVX2 to run the builds on")
    x = rng.choice(np.array([0, 1, 200, 255], np.uint8), size=(8, 64))
    want_saturating, want_exact = _saturating_sums(x, weights), x.astype(np.int32) @ weights.astype(np.int32)
    assert not np.array_equal(want_saturating, want_exact)
    np.testing.assert_array_equal(saturating.run({"x": x})["y"], want_saturating)
    np.testing.assert_array_equal(exact.run({"x": x})["y"], want_exact)
    if ORT_SATURATES:  # ONNX Runtime's own AVX2 kernel sums the same pairs
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        np.testing.assert_array_equal(session.run(None, {"x": x})[0], want_saturating)


@pytest.mark.skipif(not ORT_SATURATES, reason="ONNX Runtime saturates only on a host with AVX2 and no VNNI")
def test_a_saturating_qdq_mlp_equals_onnxruntime_bit_for_bit(tmp_path):
    """A QDQ MLP quantized by onnxruntime.quantization whose GEMMs all read ReLU outputs (zero point 0, so
    int8="saturating" gives each the saturating form): they pair the same depths as ONNX Runtime's fused
    AVX2 kernels, so the outputs are ONNX Runtime's own, saturation included."""
    fp32 = mlp(relu_input=True)
    path = quantized(fp32, str(tmp_path), activations="uint8", per_channel=True)
    compiled = souffle_py.optimize(path, int8="saturating", quiet=True, cache=False)
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    assert SATURATING_NOTE in compiled.plan.notes
    for seed in (0, 4):
        feeds = random_feeds(fp32, seed)
        np.testing.assert_array_equal(list(compiled.run(feeds).values())[0], session.run(None, feeds)[0])


def test_the_compile_cache_keeps_the_two_arithmetics_apart(tmp_path, monkeypatch):
    """int8 is part of the compile cache's key: a saturating compile is not served the exact one's export
    (nor the reverse), and the note travels with the cached plan."""
    from souffle_py import compile_cache
    monkeypatch.setenv("SOUFFLE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(compile_cache.ENABLE_ENV, "1")
    model = _matmul_integer(np.random.default_rng(1).integers(-128, 128, (64, 16)).astype(np.int8))
    exact = souffle_py.optimize(model, target=HASWELL, quiet=True, cache=True)
    saturating = souffle_py.optimize(model, target=HASWELL, quiet=True, cache=True, int8="saturating")
    assert not saturating.cached and SATURATING_NOTE in saturating.plan.notes
    again = souffle_py.optimize(model, target=HASWELL, quiet=True, cache=True, int8="saturating")
    assert again.cached and SATURATING_NOTE in again.plan.notes
    assert SATURATING_NOTE not in exact.plan.notes
