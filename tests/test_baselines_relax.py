"""TVM Relax baseline: TVM's own ONNX import and fusion agree with ONNX Runtime."""

from __future__ import annotations

import numpy as np
import pytest

from models.registry import build_model
from souffle_py.baselines import OnnxRuntimeModel, relax_tvm
from souffle_py.errors import SouffleError


def test_relax_tvm_matches_onnxruntime_on_tiny_bert():
    model = build_model("bert", tiny=True)
    relax_model = relax_tvm(model)
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    feeds = {model.graph.input[0].name: np.random.default_rng(0).standard_normal(shape).astype(np.float32)}
    expected = OnnxRuntimeModel(model).run(feeds)
    actual = relax_model.run(feeds)
    assert actual.keys() == expected.keys()
    for name in expected:
        np.testing.assert_allclose(actual[name], expected[name], atol=1e-4, rtol=1e-4)
    assert 0 < relax_model.num_kernels < len(model.graph.node)  # fused: fewer kernels than ONNX nodes


def test_relax_tvm_names_what_it_cannot_import():
    with pytest.raises(SouffleError, match="Relax ONNX importer.*LSTM"):
        relax_tvm(build_model("lstm", tiny=True))


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_relax_cuda_pipeline_builds_without_a_gpu(cuda_graph, monkeypatch):
    """TVM Relax's CUDA pipeline (dlight; with and without CUDA graphs) compiles here; running needs a GPU."""
    from gpu_util import HAS_GPU
    from souffle_py import baselines
    from souffle_py.errors import NoDeviceError

    if HAS_GPU:
        model = relax_tvm(build_model("mmoe", tiny=True), "cuda", cuda_graph=cuda_graph)
        assert model.num_kernels > 0
        return
    built = []
    monkeypatch.setattr(baselines.RelaxModel, "__init__",
                        lambda self, executable, *args, **kwargs: built.append(executable))
    relax_tvm(build_model("mmoe", tiny=True), "cuda", cuda_graph=cuda_graph)
    def modules(module):
        yield module
        for imported in module.imports:
            yield from modules(imported)

    (cuda,) = [m for m in modules(built[0].mod) if m.kind == "cuda"]
    assert "__global__" in cuda.inspect_source()
    monkeypatch.undo()
    with pytest.raises(NoDeviceError):
        relax_tvm(build_model("mmoe", tiny=True), "cuda", cuda_graph=cuda_graph)
