"""Tiny BERT (both LayerNorm spellings) and tiny LSTM (both spellings) against ONNX Runtime and unfused TVM.

Tolerance: float32, rtol 1e-4 with atol 1e-5 (outputs are O(1)).
"""

import subprocess
import sys

import numpy as np
import pytest

import souffle_py
from models.registry import build_model
from souffle_py.baselines import OnnxRuntimeModel, unfused_tvm

CONFIGS = [("bert", {"layernorm": "primitive"}), ("bert", {"layernorm": "op"}),
           ("lstm", {"spelling": "op"}), ("lstm", {"spelling": "unrolled"})]


@pytest.mark.parametrize("name,overrides", CONFIGS, ids=[f"{n}-{list(o.values())[0]}" for n, o in CONFIGS])
def test_tiny_model_matches_onnxruntime(name, overrides):
    proto = build_model(name, tiny=True, **overrides)
    compiled = souffle_py.optimize(proto)
    feeds = compiled.random_feeds(seed=1)
    ours = compiled.run(feeds)
    reference = OnnxRuntimeModel(proto, threads=1).run(feeds)
    unfused = unfused_tvm(proto).run(feeds)
    for out, expected in reference.items():
        np.testing.assert_allclose(ours[out], expected, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(ours[out], unfused[out], rtol=1e-4, atol=1e-5)
    assert compiled.num_kernels > 0
    assert compiled.benchmark(feeds, repeat=2, warmup=1)["median_ms"] > 0


def test_identical_layers_share_compiled_kernels():
    compiled = souffle_py.optimize(build_model("bert", tiny=True, layers=3), merge=False)
    two_layers = souffle_py.optimize(build_model("bert", tiny=True, layers=2), merge=False)
    assert compiled.num_kernels > two_layers.num_kernels
    assert compiled.distinct_kernels == two_layers.distinct_kernels


def test_describe_traces_kernels_to_onnx_nodes():
    for merge in (True, False):
        text = souffle_py.optimize(build_model("bert", tiny=True, layers=1), merge=merge).describe()
        assert "kernel calls" in text and "layer0/attn/q_matmul" in text


def test_cli_compile(tmp_path):
    path = tmp_path / "lstm.onnx"
    subprocess.run([sys.executable, "-m", "models", "lstm", "--tiny", "-o", str(path)], check=True)
    result = subprocess.run([sys.executable, "-m", "souffle_py.cli", "compile", str(path), "--benchmark"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "kernel calls" in result.stdout and "latency" in result.stdout


def test_cli_reports_errors_without_traceback(tmp_path):
    path = tmp_path / "bad.onnx"
    path.write_bytes(b"garbage")
    result = subprocess.run([sys.executable, "-m", "souffle_py.cli", "compile", str(path)],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert "not a valid ONNX model" in result.stderr and "Traceback" not in result.stderr


def test_profile_times_every_kernel_call_and_the_cli_prints_it(tmp_path):
    import subprocess
    import sys

    import onnx

    model = souffle_py.optimize(build_model("bert", tiny=True, layers=2), merge=False)
    rows = model.profile(repeat=3)
    assert len(rows) == len(model.plan.calls) and all(r["median_ms"] > 0 and r["alone_ms"] > 0 for r in rows)
    assert abs(sum(r["share"] for r in rows) - 1.0) < 1e-6
    assert rows == sorted(rows, key=lambda r: -r["median_ms"])
    assert all(r["flops"] == call.flops for r in rows for call in model.plan.calls if call.name == r["kernel"])
    assert sum(r["flops"] for r in rows) == sum(call.flops for call in model.plan.calls) > 0
    assert all(r["gflop_s"] == pytest.approx(r["flops"] / r["median_ms"] / 1e6) for r in rows)
    table = model.format_profile(rows, top=5)
    assert "total (kernels within inferences)" in table and "alone ms" in table and "GFLOP/s" in table
    assert len(table.splitlines()) == 1 + 5 + 1 and "peak" not in table
    rated = model.format_profile(rows, top=5, peak_gflops=100.0)
    assert len(rated.splitlines()) == 1 + 5 + 2 and rated.splitlines()[0].endswith("peak")
    floor_ms = sum(r["flops"] for r in rows) / 100.0 / 1e6
    assert f"take at least {floor_ms:.3g} ms" in rated.splitlines()[-1]
    onnx.save(build_model("mmoe", tiny=True), str(tmp_path / "m.onnx"))
    result = subprocess.run([sys.executable, "-m", "souffle_py.cli", "compile", str(tmp_path / "m.onnx"), "--profile"],
                            capture_output=True, text=True)
    assert result.returncode == 0 and "share" in result.stdout, result.stderr


@pytest.mark.parametrize("name", ["bert", "efficientnet"])
def test_every_kernel_call_names_its_onnx_nodes(name):
    """TEs made by the CPU layout passes (a transposed operand, blocked convs, paddings) carry the ONNX node
    of the TE they replace or serve, so describe() never lists an unknown node."""
    model = souffle_py.optimize(build_model(name, tiny=True), quiet=True)
    assert all(call.nodes and "?" not in call.nodes for call in model.plan.calls)


def _matmul_model(m: int, k: int, n: int):
    from onnx import TensorProto, helper, numpy_helper

    weight = numpy_helper.from_array(np.random.default_rng(0).standard_normal((k, n)).astype("float32"), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "mm",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])], [weight])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_kernel_call_counts_the_operations_of_its_tes():
    """A lone MatMul of M x K by K x N: 2MNK operations (a multiply and an add per product)."""
    m, k, n = 4, 32, 48
    model = souffle_py.optimize(_matmul_model(m, k, n), quiet=True)
    assert [call.flops for call in model.plan.calls] == [2 * m * n * k]


def test_a_model_of_little_work_says_it_runs_on_one_thread():
    """Its rate is then rated against one core's peak (profile, benchmark tables), and describe() says why."""
    from souffle_py.plan import ONE_THREAD_NOTE

    tiny = souffle_py.optimize(_matmul_model(4, 32, 48), quiet=True)
    assert tiny.single_threaded and ONE_THREAD_NOTE in tiny.describe()
    large = souffle_py.optimize(_matmul_model(256, 512, 512), quiet=True)
    assert not large.single_threaded and ONE_THREAD_NOTE not in large.describe()


def test_set_num_threads_changes_the_running_pool_and_refuses_nonsense():
    import os

    import pytest
    import tvm_ffi

    from souffle_py.backends.cpu import num_threads

    model = souffle_py.optimize(build_model("bert", tiny=True, layers=1), quiet=True)
    feeds = model.random_feeds()
    expected = model.run(feeds)
    before = num_threads()
    pool_size = tvm_ffi.get_global_func("runtime.NumThreads")
    try:
        souffle_py.set_num_threads(1)
        assert pool_size() == 1 and num_threads() == 1 and os.environ["TVM_NUM_THREADS"] == "1"
        for name, value in model.run(feeds).items():
            np.testing.assert_allclose(value, expected[name], rtol=1e-5, atol=1e-6)
    finally:
        souffle_py.set_num_threads(before)
    assert pool_size() == before
    for bad in (0, -2, 1.5, "2", True):
        with pytest.raises(souffle_py.InputError, match="positive number of threads"):
            souffle_py.set_num_threads(bad)
