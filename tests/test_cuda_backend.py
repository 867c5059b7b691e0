"""The CUDA backend without a GPU: targets, GPU schedules, generated CUDA, nvcc for sm_80 and sm_90,
resource figures, the schedule fallback, and the error when running without a GPU. On a GPU (marked
`gpu`): every model matches ONNX Runtime. Grid-synchronized kernels: test_cuda_grid.py."""

import numpy as np
import pytest
import tvm

import souffle_py
from gpu_util import HAS_GPU, threads_as_loops
from models.registry import MODEL_NAMES, build_model
from souffle_py.backends import backend_for
from souffle_py.backends.cuda import nvcc
from souffle_py.backends.cuda.schedule import bind_below_time_loops
from souffle_py.baselines import OnnxRuntimeModel, unfused_tvm
from souffle_py.codegen.build import schedule_kernels
from souffle_py.errors import NoDeviceError, SouffleError, TargetError
from souffle_py.frontend import import_onnx
from souffle_py.plan import plan_for
from souffle_py.runtime import CompiledModel

RTOL, ATOL = 1e-4, 1e-4  # float32, O(1) outputs


@pytest.fixture(scope="module")
def compiled():
    """Tiny BERT, LSTM and MMoE compiled for cuda (on a machine without a GPU: for an H100, sm_90)."""
    return {name: souffle_py.optimize(build_model(name, tiny=True), target="h100") for name in ("bert", "lstm", "mmoe")}


@pytest.mark.parametrize("name,sms,arch", [("h100", 132, "sm_90"), ("h200", 132, "sm_90"), ("a100", 108, "sm_80")])
def test_named_gpus_carry_their_specs(name, sms, arch):
    backend = backend_for(name)
    assert backend.spec.sms == sms and backend.target.attrs["arch"] == arch
    assert backend.spec.registers_per_sm == 65536 and backend.spec.max_threads_per_sm == 2048
    assert backend.spec.max_shared_memory_per_block > 48 * 1024


@pytest.mark.skipif(HAS_GPU, reason="on a GPU machine 'cuda' is the present GPU")
def test_cuda_without_a_gpu_compiles_for_an_h100_class_sm_90():
    backend = backend_for("cuda")
    assert backend.target.attrs["arch"] == "sm_90" and backend.spec.name == "H100"
    assert backend_for(tvm.target.Target("nvidia/nvidia-a100")).spec.name == "A100"


def test_unknown_gpus_are_refused_by_name():
    with pytest.raises(TargetError, match="unknown target 'h900'"):
        backend_for("h900")


@pytest.mark.parametrize("name", ["bert", "lstm", "mmoe"])
def test_tiny_models_compile_to_cuda_kernels(compiled, name):
    model = compiled[name]
    stages = [s for call in model.plan.calls for s in call.stages]
    assert sorted(stages) == sorted(op.name for op in model.program.stages)  # each TE in exactly one kernel
    source = model.device_source()
    for call in model.plan.calls:
        assert call.launches, call.name
        for launch in call.launches:
            assert f"void __launch_bounds__({launch.threads}) {launch.kernel}(" in source
            assert 0 < launch.threads <= 1024 and launch.blocks >= 1
            assert launch.registers and launch.registers <= 255 and launch.shared_bytes is not None
            assert launch.resources_from == "ptxas -v (sm_90)"


def test_describe_shows_each_launch_and_its_resources(compiled):
    text = compiled["lstm"].describe()
    assert "blocks x" in text and "registers/thread" in text and "B shared/block" in text
    assert "cooperative" in text and "grid syncs" in text and "resident blocks/SM" in text
    assert "H100 (sm_90" in text
    separate = souffle_py.optimize(build_model("lstm", tiny=True), target="h100", grid_sync=False)
    assert "x 6 launches" in separate.describe()  # without grid sync: a host loop over the 6 wavefront steps


def test_nvcc_compiles_the_generated_cuda_for_sm_80_and_sm_90(compiled):
    source = compiled["bert"].device_source()
    binary, resources = nvcc.compile_cuda(source, ("sm_80", "sm_90"))
    assert binary
    kernels = {launch.kernel for call in compiled["bert"].plan.calls for launch in call.launches}
    for arch in ("sm_80", "sm_90"):
        assert kernels <= set(resources[arch]), arch
        assert all(r.registers > 0 for r in resources[arch].values())


def test_ptxas_resource_lines_are_parsed():
    log = ("ptxas info    : Compiling entry function 'f_kernel' for 'sm_90'\n"
           "ptxas info    : Function properties for f_kernel\n"
           "    0 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
           "ptxas info    : Used 40 registers, used 1 barriers, 6144 bytes smem, 400 bytes cmem[0]\n")
    (figures,) = nvcc.parse_ptxas(log)["sm_90"].values()
    assert (figures.registers, figures.shared_bytes, figures.spill_bytes) == (40, 6144, 12)


def test_nvcc_errors_name_the_kernels_they_point_into():
    source = ('extern "C" __global__ void __launch_bounds__(32) f_kernel(float* x);\n'
              'extern "C" __global__ void __launch_bounds__(32) f_kernel(float* x) {\n  bad;\n}\n'
              'extern "C" __global__ void __launch_bounds__(64) g_kernel_1(float* x) {\n}\n')
    error = nvcc.NvccError(source, "/tmp/a/kernels.cu(3): error: identifier \"bad\" is undefined\n"
                                   "ptxas error   : Entry function 'g_kernel_1' uses too much shared data "
                                   "(0x310000 bytes, 0xc000 max)\n", ("sm_90",))
    assert error.kernels == ["f_kernel", "g_kernel_1"]


@pytest.mark.skipif(HAS_GPU, reason="this machine has a GPU")
def test_running_without_a_gpu_says_so(compiled):
    model = compiled["mmoe"]
    with pytest.raises(NoDeviceError, match="no CUDA GPU"):
        model.run(model.random_feeds())
    with pytest.raises(NoDeviceError):
        model.benchmark()


@pytest.mark.skipif(HAS_GPU, reason="this machine has a GPU")
def test_tuning_for_cuda_without_a_gpu_is_refused(tmp_path):
    with pytest.raises(SouffleError, match="measures candidates on a GPU"):
        souffle_py.optimize(build_model("mmoe", tiny=True), target="cuda", trials=8, database=tmp_path)


def test_unfused_cuda_gives_every_te_its_own_kernel():
    proto = build_model("mmoe", tiny=True)
    model = unfused_tvm(proto, "cuda")
    assert len(model.plan.calls) == len(import_onnx(proto).stages)


def test_cpu_models_have_no_device_source():
    with pytest.raises(SouffleError, match="compiled for the CPU"):
        souffle_py.optimize(build_model("mmoe", tiny=True)).device_source()


@pytest.mark.parametrize("name", ["lstm", "mmoe"])
def test_thread_per_output_schedules_compute_the_model(name):
    """The GPU kernels of the thread-per-output rule (recurrences' host time loops included), with their
    thread loops run serially on the CPU, match ONNX Runtime: the index arithmetic of the schedule."""
    proto = build_model(name, tiny=True)
    program = import_onnx(proto)
    kernels = backend_for("cuda").unfused_kernels(program, False)
    scheduled = schedule_kernels(kernels, bind_below_time_loops)
    cpu = tvm.target.Target("llvm")
    module = tvm.compile(tvm.IRModule({n: threads_as_loops(f) for n, f in scheduled.functions.items()}), target=cpu)
    plan = plan_for(program, kernels, scheduled.function_of, len(scheduled.functions), cpu, "cpu")
    model = CompiledModel(plan, module, program.params)
    feeds = model.random_feeds()
    expected = OnnxRuntimeModel(proto).run(feeds)
    for key, value in model.run(feeds).items():
        np.testing.assert_allclose(value, expected[key], rtol=RTOL, atol=ATOL)


def test_a_kernel_nvcc_rejects_gets_its_next_schedule(monkeypatch):
    """A schedule whose CUDA code nvcc rejects (dlight's vectorized code has hit CUDA codegen bugs) is
    replaced by the function's next schedule candidate and the module rebuilt."""
    compile_cuda, rejected = nvcc.compile_cuda, []

    def fail_once(source, archs, fast_math=True, output="fatbin", min_blocks_per_sm=None):
        if not rejected:
            definition = source.index("{", source.index("__global__ void __launch_bounds__",
                                                        source.index("__global__ void __launch_bounds__") + 1))
            line = source[:definition].count("\n") + 2  # inside the body of the first kernel
            error = nvcc.NvccError(source, f"/tmp/x/kernels.cu({line}): error: injected\n", archs)
            rejected.extend(error.kernels)
            raise error
        return compile_cuda(source, archs, fast_math, output, min_blocks_per_sm)

    monkeypatch.setattr(nvcc, "compile_cuda", fail_once)
    model = souffle_py.optimize(build_model("mmoe", tiny=True), target="cuda", merge=False)
    assert rejected and model.device_binary()


# --- on a GPU ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("merge,grid_sync", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_models_match_onnx_runtime_on_the_gpu(name, merge, grid_sync):
    """Merged (grid-synchronized) == merged stages launched separately == unfused == ONNX Runtime."""
    proto = build_model(name, tiny=True)
    model = souffle_py.optimize(proto, target="cuda", merge=merge, grid_sync=grid_sync)
    feeds = model.random_feeds()
    expected = OnnxRuntimeModel(proto).run(feeds)
    for key, value in model.run(feeds).items():
        np.testing.assert_allclose(value, expected[key], rtol=RTOL, atol=ATOL)
    assert model.benchmark(feeds, repeat=3)["median_ms"] > 0
