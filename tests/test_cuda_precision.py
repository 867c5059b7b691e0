"""Reduced precision on the GPU (te_passes/precision.py's `Native` encoding, backends/cuda/tensor_cores.py):
GEMM operands in float16 / bfloat16 on tensor cores (wmma, float32 accumulation), without a GPU: the TE
rewrite, the generated CUDA, nvcc for sm_80 and sm_90 with `mma` in the PTX, the plan's precision, fp32
unchanged, and the archs that cannot serve a precision. With a GPU (`-m gpu`): outputs against ONNX Runtime.

The error bound (GPU test): a type of p significant bits rounds an operand with a relative error of at most
u = 2^-p (float16: p = 11, bfloat16: p = 8); as in tests/test_precision.py, each output's max abs error is
bounded by 8u of the output's largest magnitude.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper

import souffle_py
from models.registry import build_model
from souffle_py.backends import backend_for
from gpu_util import compiled_case
from souffle_py.backends.cuda import nvcc
from souffle_py.baselines import OnnxRuntimeModel
from souffle_py.errors import TargetError
from souffle_py.frontend import load_model, lower
from souffle_py.passes import prepared
from souffle_py.ir.marks import REDUCED_GEMM
from te_passes.precision import Native, bf16_values, reduce_precision

SIGNIFICANT_BITS = {"fp16": 11, "bf16": 8}
STORAGE = {"fp16": "float16", "bf16": "bfloat16"}
# one layer of a BERT whose FFN GEMMs (128 x 256 x 1024: 67 MFLOP) are large enough for kernels of their own
BERT = dict(tiny=True, hidden=256, heads=4, ffn=1024, seq=128, layers=1)


def gemm_model(rows: int = 64, depth: int = 1024, cols: int = 512) -> onnx.ModelProto:
    """x @ W + b, then ReLU: one GEMM of 67 MFLOP with its epilogue."""
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array((rng.standard_normal((depth, cols)) / np.sqrt(depth)).astype(np.float32), "w")
    bias = numpy_helper.from_array(rng.standard_normal(cols).astype(np.float32), "b")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Add", ["y", "b"], ["z"]),
             helper.make_node("Relu", ["z"], ["out"])]
    graph = helper.make_graph(nodes, "gemm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, depth])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [rows, cols])], [weight, bias])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


MODELS = {"bert": lambda: build_model("bert", **BERT), "gemm": gemm_model}
# each model in both precisions, on both archs between them (compiling is the slow part: 4 compiles)
CASES = [("bert", "fp16", "a100"), ("bert", "bf16", "h100"), ("gemm", "bf16", "a100"), ("gemm", "fp16", "h100")]


@pytest.fixture(scope="module", params=CASES, ids=["-".join(case) for case in CASES])
def compiled(request):
    return compiled_case(MODELS, request.param)


def test_the_gemms_run_on_tensor_cores(compiled):
    name, precision, target, model = compiled
    source = model.device_source()
    assert "nvcuda::wmma::mma_sync" in source
    assert f"wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 16, {'half' if precision == 'fp16' else 'nv_bfloat16'}" \
        in source
    assert "wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float>" in source  # float32 accumulation
    arch = {"a100": "sm_80", "h100": "sm_90"}[target]
    assert all(l.resources_from == f"ptxas -v ({arch})" for call in model.plan.calls for l in call.launches)
    reasons = " ".join(call.reason for call in model.plan.calls)
    assert f"{STORAGE[precision]} GEMM keeps a tensor-core kernel" in reasons


def test_nvcc_compiles_them_for_sm_80_and_sm_90_with_mma_in_the_ptx(compiled):
    *_, model = compiled
    for arch in ("sm_80", "sm_90"):
        ptx, _ = nvcc.compile_cuda(model.device_source(), (arch,), output="ptx")
        assert "wmma.mma.sync" in ptx.decode() or "mma.sync" in ptx.decode()


def test_the_plan_records_the_precision(compiled):
    _, precision, _, model = compiled
    assert model.plan.precision == precision and f"precision {precision}" in model.describe()


def test_the_policy_converts_gemm_operands_only():
    """Weights converted once (bf16 as its bits), GEMMs and attention's batch matmuls read the reduced type;
    softmax, layer norms and the output stay float32; no conversion TE for an element-wise producer."""
    program = lower(load_model(build_model("bert", tiny=True)))
    for precision in ("fp16", "bf16"):
        converted = reduce_precision(program, precision, Native(precision))
        gemms = [op for op in converted.stages if REDUCED_GEMM in (op.attrs or {})]
        assert len(gemms) == 2 * 8  # per layer: Q, K, V, scores, context, out, fc1, fc2
        assert all(str(t.dtype) == STORAGE[precision] for op in gemms for t in op.input_tensors)
        assert all(str(op.output(0).dtype) == "float32" for op in gemms)
        norms = [op for op in converted.stages if "softmax_max" in op.name or op.name.endswith("ln_mean")]
        assert norms and all(str(op.output(0).dtype) == "float32" for op in norms)
        weights = {name: value for name, value in converted.params.items() if name.endswith(f"_{precision}")}
        assert weights and all(value.dtype == (np.uint16 if precision == "bf16" else np.float16)
                               for value in weights.values())
        assert "layer0_ffn_gelu_mul_" + precision in {op.name for op in converted.stages}  # GELU's epilogue
    name = next(n for n in converted.params if n.endswith("_bf16"))
    original = program.params[name[:-len("_bf16")]]
    assert np.abs(bf16_values(converted.params[name]) - original).max() <= 2.0 ** -8 * np.abs(original).max()


def test_fp32_cuda_code_is_unchanged_by_the_precision_option():
    proto = build_model("bert", tiny=True)
    default = souffle_py.optimize(proto, target="a100", quiet=True)
    explicit = souffle_py.optimize(proto, target="a100", precision="fp32", quiet=True)
    assert default.device_source() == explicit.device_source()
    assert "wmma" not in default.device_source() and "half" not in default.plan.to_json()
    assert default.plan.precision == "fp32"
    program = lower(load_model(proto))
    backend_for("h100").check_precision("fp32")
    assert prepared(program, backend_for("h100"), only={"reduce_precision"}) is program


@pytest.mark.parametrize("arch, precision", [("sm_75", "bf16"), ("sm_61", "fp16"), ("sm_61", "bf16")])
def test_archs_without_the_tensor_cores_are_refused_by_name(arch, precision):
    program = lower(load_model(gemm_model()))
    backend = backend_for(tvm.target.Target({"kind": "cuda", "arch": arch}))
    with pytest.raises(TargetError, match=f"{arch}.*sm_{70 if precision == 'fp16' else 80}|"
                                          f"sm_{70 if precision == 'fp16' else 80}.*{arch}"):
        backend.check_precision(precision)
    sm80 = backend_for(tvm.target.Target({"kind": "cuda", "arch": "sm_80"}))
    sm80.check_precision(precision)
    assert prepared(program, sm80, precision=precision, only={"reduce_precision"}) is not program


@pytest.mark.gpu
@pytest.mark.parametrize("name, precision", [("bert", "fp16"), ("bert", "bf16"), ("gemm", "fp16"), ("gemm", "bf16")])
def test_outputs_within_the_mantissa_bound_on_the_gpu(name, precision):
    proto = MODELS[name]()
    model = souffle_py.optimize(proto, target="cuda", precision=precision, quiet=True)
    feeds = model.random_feeds(0)
    ours, reference = model.run(feeds), OnnxRuntimeModel(proto, threads=1).run(feeds)
    tolerance = 8 * 2.0 ** -SIGNIFICANT_BITS[precision]
    for output, expected in reference.items():
        error = np.abs(ours[output].astype(np.float64) - expected).max()
        assert error <= tolerance * np.abs(expected).max(), f"{output}: max abs error {error:.3g}"


def test_fp16_grid_kernels_on_cuda_cores_run_phase_by_phase_within_the_mantissa_bound(caplog, monkeypatch):
    """The GEMM stages of a grid kernel that stay on CUDA cores (dlight's transplanted schedules: here the
    wmma rule refuses them, its tensor cores marked absent) read float16 operands: run phase by phase on
    the CPU, as tests/test_cuda_grid.py runs fp32 kernels, against ONNX Runtime within the float16 bound.
    (Grid kernels on tensor cores: tests/test_cuda_grid_tensor_cores.py.)"""
    from gpu_util import run_phases_on_cpu
    from souffle_py.backends.cuda import tensor_cores, transplant
    from souffle_py.codegen.build import schedule_kernels
    from souffle_py.structural import StructuralMap
    from souffle_py.passes import transformed

    proto = build_model("bert", tiny=True, layers=1, hidden=128, heads=2, ffn=256, seq=64)
    backend = backend_for("h100")
    program = transformed(lower(load_model(proto)))[0]
    program = prepared(program, backend, "-vertical,-horizontal", "fp16")
    monkeypatch.setattr(tensor_cores, "MIN_ARCH", {"fp16": 100, "bf16": 100})
    monkeypatch.setattr(transplant, "_TENSOR_CORE_TRACES", StructuralMap())
    with caplog.at_level("WARNING"):
        kernels = backend.fused_kernels(program, False)
    assert "run as separate kernels" not in caplog.text
    scheduled = schedule_kernels(kernels, backend.default_scheduler(kernels))
    assert any("dlight Matmul" in str(func.attrs.get("souffle.stage_schedules", {})) for func in
               scheduled.functions.values() if func.attrs is not None)
    model = run_phases_on_cpu(program, kernels, scheduled.functions, scheduled.function_of)
    feeds = model.random_feeds()
    expected = OnnxRuntimeModel(proto).run(feeds)
    for key, value in model.run(feeds).items():
        error = np.abs(value.astype(np.float64) - expected[key]).max()
        assert error <= 8 * 2.0 ** -11 * np.abs(expected[key]).max(), f"{key}: max abs error {error:.3g}"
