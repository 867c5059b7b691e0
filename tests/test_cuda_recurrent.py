"""GRU, RNN and bidirectional LSTM on CUDA without a GPU: like the LSTM, each model is one grid-synchronized
(cooperative) kernel whose time loop runs inside it, nvcc compiles it, and run phase by phase on the CPU
(what its grid barriers guarantee) it matches ONNX Runtime."""

import numpy as np
import pytest

import souffle_py
from gpu_util import run_phases_on_cpu
from models.registry import build_model
from souffle_py.backends import backend_for
from souffle_py.backends.cuda import nvcc
from souffle_py.baselines import OnnxRuntimeModel
from souffle_py.codegen.build import schedule_kernels
from souffle_py.frontend import import_onnx
from souffle_py.passes import prepared, transformed
from test_recurrent_cells import recurrent_model

MODELS = {
    "gru": lambda: build_model("gru", tiny=True),
    "gru-reset-before": lambda: build_model("gru", tiny=True, linear_before_reset=0),
    "bilstm": lambda: build_model("bilstm", tiny=True),
    "rnn-bidirectional-lens": lambda: recurrent_model("RNN", direction="bidirectional", lens=[3, 5, 1], initial=True)[0],
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_one_cooperative_kernel_that_nvcc_compiles(name):
    model = souffle_py.optimize(MODELS[name](), target="h100")
    (call,) = model.plan.calls
    (launch,) = call.launches
    assert model.num_kernels == 1 and launch.cooperative and launch.grid_syncs >= 1
    source = model.device_source()
    assert "cooperative_groups" in source and "grid_sync()" in source
    binary, resources = nvcc.compile_cuda(source, ("sm_80", "sm_90"))
    assert binary and all(launch.kernel in resources[arch] for arch in ("sm_80", "sm_90"))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_grid_kernel_run_phase_by_phase_matches_onnx_runtime(name):
    proto = MODELS[name]()
    backend = backend_for("h100")
    program = prepared(import_onnx(proto), backend)
    kernels = backend.fused_kernels(program, False)
    scheduled = schedule_kernels(kernels, backend.default_scheduler())
    model = run_phases_on_cpu(program, kernels, scheduled.functions, scheduled.function_of)
    feeds = model.random_feeds()
    expected = OnnxRuntimeModel(proto).run(feeds)
    for key, value in model.run(feeds).items():
        np.testing.assert_allclose(value, expected[key], rtol=1e-4, atol=1e-4)
