"""Export and load: one file (library, plan, weights; no pickle) that runs where only TVM's runtime is."""

import json
import subprocess
import sys
import tarfile

import numpy as np
import onnx
import pytest

import souffle_py
from gpu_util import HAS_GPU
from models.registry import build_model
from souffle_py.errors import ExportError, NoDeviceError


def test_cpu_model_round_trips(tmp_path):
    proto = build_model("bert", tiny=True)
    model = souffle_py.optimize(proto)
    path = tmp_path / "bert.tar"
    model.export(path)
    with tarfile.open(path) as archive:
        assert sorted(archive.getnames()) == ["kernels.so", "params.npz", "plan.json", "plan.sha256"]
        plan = json.loads(archive.extractfile("plan.json").read())
    assert plan["device"] == "cpu" and len(plan["calls"]) == len(model.plan.calls)
    loaded = souffle_py.load(path)
    feeds = model.random_feeds(seed=3)
    expected = model.run(feeds)
    for key, value in loaded.run(feeds).items():
        np.testing.assert_array_equal(value, expected[key])
    assert loaded.describe() == model.describe().replace(model.target_description, loaded.target_description)
    assert loaded.num_kernels == model.num_kernels
    assert loaded.plan.calls == model.plan.calls and all(call.flops > 0 for call in loaded.plan.calls)


def test_loaded_model_checks_its_inputs(tmp_path):
    model = souffle_py.optimize(build_model("mmoe", tiny=True))
    model.export(tmp_path / "m.tar")
    loaded = souffle_py.load(tmp_path / "m.tar")
    with pytest.raises(souffle_py.InputError, match="missing input"):
        loaded.run({})


def test_cuda_model_exports_its_device_binary(tmp_path):
    model = souffle_py.optimize(build_model("mmoe", tiny=True), target="cuda")
    path = tmp_path / "mmoe-cuda.tar"
    model.export(path)
    with tarfile.open(path) as archive:
        assert set(archive.getnames()) == {"device.bin", "device.cu", "kernels.so", "plan.json", "plan.sha256",
                                           "params.npz"}
    loaded = souffle_py.load(path)
    assert loaded.device_source() == model.device_source()
    assert loaded.device_binary() == model.device_binary()
    assert "blocks x" in loaded.describe()
    if not HAS_GPU:
        with pytest.raises(NoDeviceError, match="no CUDA GPU"):
            loaded.run(loaded.random_feeds())


@pytest.mark.gpu
def test_cuda_model_runs_after_load(tmp_path):
    from souffle_py.baselines import OnnxRuntimeModel

    proto = build_model("bert", tiny=True)
    souffle_py.optimize(proto, target="cuda").export(tmp_path / "bert.tar")
    loaded = souffle_py.load(tmp_path / "bert.tar")
    feeds = loaded.random_feeds()
    expected = OnnxRuntimeModel(proto).run(feeds)
    for key, value in loaded.run(feeds).items():
        np.testing.assert_allclose(value, expected[key], rtol=1e-4, atol=1e-4)


def test_not_an_exported_model_is_refused(tmp_path):
    (tmp_path / "junk.tar").write_bytes(b"not a tar file")
    with pytest.raises(ExportError, match="cannot read"):
        souffle_py.load(tmp_path / "junk.tar")
    with tarfile.open(tmp_path / "empty.tar", "w"):
        pass
    with pytest.raises(ExportError, match="lacks plan.json"):
        souffle_py.load(tmp_path / "empty.tar")


def test_cli_compiles_for_cuda_into_one_file(tmp_path):
    onnx.save(build_model("mmoe", tiny=True), str(tmp_path / "mmoe.onnx"))
    out = tmp_path / "mmoe.tar"
    result = subprocess.run([sys.executable, "-m", "souffle_py.cli", "compile", str(tmp_path / "mmoe.onnx"),
                             "--target", "cuda", "-o", str(out)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "registers/thread" in result.stdout and out.exists()
    assert souffle_py.load(out).plan.device == "cuda"
