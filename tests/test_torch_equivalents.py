"""The PyTorch baselines compute what the ONNX models compute, with the same weights, and fail clearly.

Outputs are compared with ONNX Runtime (CPU) in float32 at rtol 1e-4 / atol 1e-4, the benchmark's own
tolerance. Tests that need PyTorch skip without it (CI has none); the one that checks that everything still
imports without PyTorch always runs.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from models.registry import build_model
from models.torch_equivalents import TORCH_MODEL_NAMES
from souffle_py.errors import InputError, SouffleError

RTOL = ATOL = 1e-4

# every model's tiny config, plus the alternative spellings that change which weights the graph holds
CASES = [(name, {}) for name in TORCH_MODEL_NAMES] + [
    ("lstm", {"spelling": "unrolled"}),
    ("bert", {"layernorm": "op", "batch": 2}),
    ("resnext", {"fold_bn": True}),
    ("swin", {"batch": 2}),
]


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


def random_feeds(proto, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
            for i in proto.graph.input}


def onnx_runtime(proto, feeds) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


def assert_matches_onnx_runtime(model, proto, feeds) -> float:
    expected = onnx_runtime(proto, feeds)
    outputs = model.run(feeds)
    assert list(outputs) == list(expected)
    for name, value in expected.items():
        assert outputs[name].shape == value.shape and outputs[name].dtype == np.float32
        np.testing.assert_allclose(outputs[name], value, rtol=RTOL, atol=ATOL)
    return max(float(np.abs(outputs[k] - v).max()) for k, v in expected.items())


@pytest.mark.parametrize("name,overrides", CASES, ids=lambda v: str(v) if isinstance(v, dict) else v)
def test_eager_matches_onnx_runtime(torch, name, overrides):
    from souffle_py.baselines_torch import TorchModel

    proto = build_model(name, tiny=True, **overrides)
    feeds = random_feeds(proto)
    assert_matches_onnx_runtime(TorchModel(proto, mode="eager", device="cpu"), proto, feeds)


def test_torch_module_is_an_ordinary_module_in_eval_mode(torch):
    from models.torch_equivalents import torch_equivalent

    proto = build_model("resnext", tiny=True)
    module = torch_equivalent(proto)
    assert isinstance(module, torch.nn.Module) and not module.training
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in module.modules())
    x = random_feeds(proto)["input"]
    with torch.no_grad():
        y = module(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(y, onnx_runtime(proto, {"input": x})["output"], rtol=RTOL, atol=ATOL)


def test_compile_on_cpu_matches_onnx_runtime(torch):
    """torch.compile(mode="reduce-overhead") on the smallest model (a few seconds of inductor compile)."""
    from souffle_py.baselines_torch import TorchModel

    proto = build_model("mmoe", tiny=True)
    feeds = random_feeds(proto)
    model = TorchModel(proto, mode="compile", device="cpu")
    assert_matches_onnx_runtime(model, proto, feeds)
    timing = model.benchmark(feeds, repeat=3, warmup=1)
    assert timing["repeat"] == 3 and len(timing["times_ms"]) == 3
    assert timing["min_ms"] <= timing["median_ms"] <= timing["max_ms"]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_runs_close_to_float32(torch, dtype):
    """Lower precision is an option for other benchmarks; outputs still come back as float32."""
    from souffle_py.baselines_torch import TorchModel

    proto = build_model("mmoe", tiny=True)
    feeds = random_feeds(proto)
    outputs = TorchModel(proto, mode="eager", device="cpu", dtype=dtype).run(feeds)
    assert outputs["output"].dtype == np.float32
    np.testing.assert_allclose(outputs["output"], onnx_runtime(proto, feeds)["output"], atol=2e-2)


def test_systems_and_tf32(torch):
    from souffle_py.baselines_torch import TorchModel, torch_available, torch_systems

    assert torch_available()
    assert list(torch_systems("cuda")) == ["PyTorch eager", "PyTorch CUDA graph",
                                           "PyTorch torch.compile (reduce-overhead)"]
    cpu_systems = torch_systems("cpu")
    assert "PyTorch CUDA graph" not in cpu_systems
    model = cpu_systems["PyTorch eager"](build_model("lstm", tiny=True))
    assert isinstance(model, TorchModel) and model.mode == "eager" and model.num_kernels is None
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32


def test_user_errors(torch):
    from souffle_py.baselines_torch import TorchModel

    proto = build_model("mmoe", tiny=True)
    with pytest.raises(SouffleError, match="CUDA graph needs a CUDA device"):
        TorchModel(proto, mode="graph", device="cpu")
    with pytest.raises(SouffleError, match="unknown PyTorch mode"):
        TorchModel(proto, mode="jit", device="cpu")
    if not torch.cuda.is_available():
        with pytest.raises(SouffleError, match="no CUDA device"):
            TorchModel(proto, mode="eager", device="cuda")
    model = TorchModel(proto, mode="eager", device="cpu")
    x = random_feeds(proto)["input"]
    with pytest.raises(InputError, match="missing input"):
        model.run({"x": x})
    with pytest.raises(InputError, match="shape"):
        model.run({"input": x[:, :3]})
    with pytest.raises(InputError, match="dtype"):
        model.run({"input": x.astype(np.float64)})


def test_foreign_or_changed_graphs_are_refused(torch):
    from models.torch_equivalents import torch_equivalent, torch_module

    proto = build_model("mmoe", tiny=True)
    proto.graph.name = "my_model"
    with pytest.raises(SouffleError, match="was not built by models/"):
        torch_equivalent(proto)
    with pytest.raises(SouffleError, match="no PyTorch equivalent for model 'gpt'"):
        torch_module("gpt", proto)
    proto = build_model("mmoe", tiny=True)
    extra = onnx.TensorProto()
    extra.CopyFrom(proto.graph.initializer[-1])
    extra.name = "task0/tower/fc2/weight"  # a weight the torch module would silently ignore
    proto.graph.initializer.append(extra)
    with pytest.raises(SouffleError, match="does not use the ONNX weights task0/tower/fc2/weight"):
        torch_module("mmoe", proto)
    proto = build_model("bert", tiny=True)
    del proto.graph.initializer[-1]
    with pytest.raises(SouffleError, match="has no initializer"):
        torch_module("bert", proto)


def test_imports_without_torch():
    """CI has no PyTorch: the modules import, torch_available() is False and asking for a model says why."""
    script = textwrap.dedent("""
        import sys
        sys.modules["torch"] = None  # makes `import torch` raise ImportError
        from models.registry import build_model
        from models.torch_equivalents import torch_equivalent
        from souffle_py.baselines_torch import TorchModel, torch_available
        from souffle_py.errors import SouffleError
        assert not torch_available()
        for build in (lambda: TorchModel(build_model("mmoe", tiny=True), device="cpu"),
                      lambda: torch_equivalent(build_model("mmoe", tiny=True))):
            try:
                build()
            except SouffleError as exc:
                assert "need PyTorch" in str(exc), exc
            else:
                raise AssertionError("no error without torch")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
