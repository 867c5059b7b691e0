"""Tensor cores inside grid-synchronized kernels (tensor_cores.GridTensorCores, transplant.py, wmma_stages.py)
without a GPU: with precision fp16 / bf16, the GEMM stages of a cooperative kernel multiply wmma fragments
(float32 accumulators); the CUDA source, nvcc for sm_80 and sm_90 with `mma` in the PTX, fp32 kernels
without wmma, the stages that stay on CUDA cores and the log that says why. Index math, in two halves:
the same kernel with its wmma loops left untensorized (fragments as thread-local arrays) runs phase by
phase on the CPU (gpu_util, blocks and warps in shuffled order) against ONNX Runtime, on the default grid
and on a grid of fewer blocks than tiles (blocks take several tiles in turn): the tiles, cooperative loads,
write-backs and per-block tile counts; and a numpy model of wmma runs each stage's wmma calls as the CUDA
source writes them: the intrinsics' pointers, strides and layouts. With a GPU (`-m gpu`): outputs against
ONNX Runtime.

The error bound, as in tests/test_cuda_precision.py: 8u of each output's largest magnitude, u = 2^-p
(float16: p = 11, bfloat16: p = 8).
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm_ffi
from onnx import TensorProto, helper, numpy_helper
from tvm import s_tir

import souffle_py
import wmma_model
from gpu_util import compiled_case, run_phases_on_cpu, syncs_in_divergent_code
from models.registry import build_model
from souffle_py.backends import backend_for
from souffle_py.backends.cuda import grid, nvcc, tensor_cores, transplant
from souffle_py.backends.cuda.schedule import gpu_schedules
from souffle_py.backends.cuda.transplant import TENSOR_CORES
from souffle_py.baselines import OnnxRuntimeModel
from souffle_py.codegen.build import schedule_kernels
from souffle_py.frontend import load_model, lower
from souffle_py.structural import StructuralMap
from souffle_py.passes import prepared, transformed

SIGNIFICANT_BITS = {"fp16": 11, "bf16": 8}
FRAGMENT_TYPE = {"fp16": "half", "bf16": "nv_bfloat16"}
# one BERT layer in one cooperative kernel, its five GEMM stages (QKV, P.V, out, fc1, fc2) whole 64 x 64 tiles
BERT = dict(tiny=True, layers=1, hidden=128, heads=2, ffn=256, seq=64)


def gemm_chain(rows: int = 64, width: int = 128, inner: int = 256):
    """relu(x @ W1 + b1) @ W2 + x: two GEMM stages of one grid kernel."""
    rng = np.random.default_rng(0)

    def weight(name, shape):
        return numpy_helper.from_array((rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32), name)

    inits = [weight("w1", (width, inner)), weight("w2", (inner, width)),
             numpy_helper.from_array(rng.standard_normal(inner).astype(np.float32), "b1")]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Add", ["h", "b1"], ["hb"]),
             helper.make_node("Relu", ["hb"], ["r"]), helper.make_node("MatMul", ["r", "w2"], ["y"]),
             helper.make_node("Add", ["y", "x"], ["out"])]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, width])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [rows, width])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


MODELS = {"bert": lambda: build_model("bert", **BERT), "chain": gemm_chain, "chain-128": lambda: gemm_chain(rows=128)}
STAGES = {"bert": 5, "chain": 2, "chain-128": 2}
CASES = [("bert", "fp16", "h100"), ("bert", "bf16", "a100"), ("chain", "fp16", "a100"), ("chain", "bf16", "h100")]


@pytest.fixture(scope="module", params=CASES, ids=["-".join(case) for case in CASES])
def compiled(request):
    return compiled_case(MODELS, request.param)


def test_the_grid_kernels_gemm_stages_run_on_tensor_cores(compiled):
    name, precision, _, model = compiled
    (call,) = model.plan.calls
    (launch,) = call.launches
    assert launch.cooperative and launch.grid_syncs > 0
    assert [source for _, source in launch.stage_schedules] == [TENSOR_CORES] * STAGES[name]
    source = model.device_source()
    assert source.count("nvcuda::wmma::mma_sync") == STAGES[name]
    assert f"wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 16, {FRAGMENT_TYPE[precision]}" in source
    assert "wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float>" in source  # float32 accumulation
    assert syncs_in_divergent_code(source) == []  # every thread of a block reaches every __syncthreads
    assert f"{STAGES[name]} GEMM stages on their own {TENSOR_CORES} schedules" in model.describe()


def test_nvcc_compiles_them_for_sm_80_and_sm_90_with_mma_in_the_ptx(compiled):
    *_, model = compiled
    for arch in ("sm_80", "sm_90"):
        ptx, _ = nvcc.compile_cuda(model.device_source(), (arch,), output="ptx")
        assert "wmma.mma.sync" in ptx.decode() or "mma.sync" in ptx.decode()


def test_a_numpy_model_of_the_wmma_calls_multiplies_each_stages_tiles(compiled):
    """Each stage's wmma calls, as the generated CUDA writes them (pointer offsets, ldm, layouts, fragment
    indices), executed by a numpy model of wmma for all 8 warps of a block (tests/wmma_model.py): the
    stored 64 x 64 accumulator tile is the product of the staged 64-row operand tiles, every element
    written once, no fragment reading a tile's row padding or a misaligned pointer."""
    name, *_, model = compiled
    source = model.device_source()
    codes = wmma_model.stages(source)
    assert len(codes) == STAGES[name]
    for code in codes:
        a, b, stored, expected = wmma_model.run_stage(source, code, np.random.default_rng(0))
        assert a.shape[0] == b.shape[0] == 64 and stored.shape == (64, 64)
        np.testing.assert_allclose(stored, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name, precision, blocks", [("bert", "fp16", None), ("bert", "bf16", None),
                                                     ("chain", "fp16", 2), ("chain-128", "fp16", None)])
def test_untensorized_twins_run_phase_by_phase_match_onnx_runtime(name, precision, blocks, monkeypatch):
    """The kernel's schedule with its wmma loops left as loops (the intrinsics' own semantics: a 16 x 16
    fragment load, multiply-accumulate or store), run on the CPU: every tile computed once, by the warps
    and from the shared-memory tiles the schedule says. `blocks` 2: the chain's 2 and 4 tiles per stage
    taken in turns (a block's count of tiles per stage, wmma_stages.per_block_tiles). chain-128: two rows
    of tiles, one turn per block (its turn counter taken as 0, so that TVM's tensorize divides the tile
    index into rows and columns)."""
    proto = MODELS[name]()
    backend = backend_for("h100")
    program = transformed(lower(load_model(proto)))[0]
    program = prepared(program, backend, "-vertical,-horizontal", precision)
    kernels = backend.fused_kernels(program, False)
    scheduled = schedule_kernels(kernels, backend.default_scheduler(kernels))
    monkeypatch.setattr(grid, "tensorize_marked", lambda sch: None)
    functions = {}
    for function, kernel in scheduled.kernel_of.items():
        func = kernel.func if blocks is None else grid.with_grid(kernel.func, blocks, [])
        _, twin = next(gpu_schedules(func, backend.target))
        assert [source for _, source in grid.stage_sources(twin)] == [TENSOR_CORES] * STAGES[name]
        functions[function] = _fragments_as_locals(twin).with_attr("global_symbol", function)
    model = run_phases_on_cpu(program, kernels, functions, scheduled.function_of, reverse=True)
    feeds = model.random_feeds()
    expected = OnnxRuntimeModel(proto).run(feeds)
    for key, value in model.run(feeds).items():
        error = np.abs(value.astype(np.float64) - expected[key]).max()
        assert error <= 8 * 2.0 ** -SIGNIFICANT_BITS[precision] * np.abs(expected[key]).max(), error


def _fragments_as_locals(func):
    """`func` with its wmma fragments (wmma.matrix_a / matrix_b / accumulator) as thread-local arrays."""
    sch = s_tir.Schedule(func)
    names = []
    tvm_ffi.structural_walk(func.body, [(s_tir.stmt.SBlock, lambda b: names.append(b.name_hint) if any(
        str(w.source.scope()).startswith("wmma.") for w in b.writes) else None)])
    assert names
    for name in dict.fromkeys(names):
        sch.set_scope(sch.get_sblock(name), 0, "local")
    return sch.mod["main"]


def test_fp32_grid_kernels_have_no_tensor_cores():
    model = souffle_py.optimize(build_model("bert", **BERT), target="h100", quiet=True)
    launches = [launch for call in model.plan.calls for launch in call.launches if launch.cooperative]
    assert {source for launch in launches for _, source in launch.stage_schedules} == {"dlight Matmul"}
    assert "wmma" not in model.device_source()


def _grid_stage_sources(proto, precision, caplog, then=lambda: None):
    """(the grid kernel's stage sources, the kernel) of `proto` in `precision`; `then()` runs once the
    program reads reduced operands."""
    backend = backend_for("h100")
    program = transformed(lower(load_model(proto)))[0]
    program = prepared(program, backend, "-vertical,-horizontal", precision)
    then()
    with caplog.at_level("INFO", logger="souffle_py.backends.cuda"):  # the kernels are scheduled to cut them
        kernels = backend.fused_kernels(program, False)
        scheduled = schedule_kernels(kernels, backend.default_scheduler(kernels))
    (func,) = scheduled.functions.values()
    return [source for _, source in grid.stage_sources(func)], func


def test_gemm_stages_of_no_whole_tiles_stay_on_cuda_cores_and_the_log_says_why(caplog):
    sources, func = _grid_stage_sources(gemm_chain(rows=48), "fp16", caplog)
    assert sources == [] and "wmma" not in func.script()
    assert "stage s1 stays on CUDA cores: its 48 x 256 x 128 GEMM is not whole 64 x 64 x 16 tiles" in caplog.text


def test_a_stage_the_wmma_rule_refuses_keeps_dlights_schedule_and_the_log_says_why(caplog, monkeypatch):
    def refuse():  # after the precision check; the stages' wmma schedules made again
        monkeypatch.setattr(tensor_cores, "MIN_ARCH", {"fp16": 100, "bf16": 100})
        monkeypatch.setattr(transplant, "_TENSOR_CORE_TRACES", StructuralMap())

    sources, func = _grid_stage_sources(gemm_chain(), "fp16", caplog, then=refuse)
    assert sources == ["dlight Matmul"] * 2 and "wmma" not in func.script()
    assert "stage s1 stays on CUDA cores: sm_90 has no float16 tensor cores" in caplog.text


def test_a_tensor_core_stage_that_does_not_transplant_keeps_dlights_schedule_and_the_log_says_why(caplog,
                                                                                                   monkeypatch):
    warp_level = transplant._warp_level

    def refuse(sch, loops, tags):  # a tensor-core stage: its warps alone are bound
        if warp_level(sch, loops, tags):
            raise transplant.TransplantError("no warps for this test")
        return False

    monkeypatch.setattr(transplant, "_warp_level", refuse)
    sources, func = _grid_stage_sources(gemm_chain(), "bf16", caplog)
    assert sources == ["dlight Matmul"] * 2 and "wmma" not in func.script()
    assert f"stage s1: its {TENSOR_CORES} schedule does not transplant (no warps for this test)" in caplog.text


@pytest.mark.gpu
@pytest.mark.parametrize("name, precision", [("bert", "fp16"), ("bert", "bf16"), ("chain", "fp16")])
def test_grid_kernels_on_tensor_cores_within_the_mantissa_bound_on_the_gpu(name, precision):
    proto = MODELS[name]()
    model = souffle_py.optimize(proto, target="cuda", precision=precision, quiet=True)
    assert TENSOR_CORES in {source for call in model.plan.calls for launch in call.launches
                            for _, source in launch.stage_schedules}
    feeds = model.random_feeds(0)
    ours, reference = model.run(feeds), OnnxRuntimeModel(proto, threads=1).run(feeds)
    tolerance = 8 * 2.0 ** -SIGNIFICANT_BITS[precision]
    for output, expected in reference.items():
        error = np.abs(ours[output].astype(np.float64) - expected).max()
        assert error <= tolerance * np.abs(expected).max(), f"{output}: max abs error {error:.3g}"
