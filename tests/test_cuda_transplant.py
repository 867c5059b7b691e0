"""GEMM stages of grid kernels on their own schedules (backends/cuda/transplant.py), without a GPU: the
trace edit, what the generated kernel holds, the kernels run on the CPU phase by phase against ONNX
Runtime (dlight's 256-thread schedule, a schedule with fewer threads than the kernel, grid.py's own
tile), refusals, and tuned records replayed from a database."""

import dataclasses

import numpy as np
import pytest
from tvm import s_tir
from tvm.s_tir import dlight as dl

import souffle_py
from gpu_util import run_phases_on_cpu, syncs_in_divergent_code
from models.registry import build_model
from souffle_py.backends import backend_for
from souffle_py.backends.cuda import nvcc, transplant
from souffle_py.backends.cuda.grid import tileable
from souffle_py.backends.cuda.launches import thread_aliased_blocks
from souffle_py.baselines import OnnxRuntimeModel
from souffle_py.codegen.build import schedule_kernels
from souffle_py.frontend import import_onnx
from souffle_py.schedule import tuning
from souffle_py.passes import prepared, transformed

BERT_TILED = dict(layers=1, hidden=256, ffn=1024, seq=128, heads=4)  # every GEMM divides into 64 x 64 tiles
RTOL, ATOL = 1e-4, 1e-4


def _proto():
    return build_model("bert", tiny=True, **BERT_TILED)


def _matmul_with_threads(x: int, y: int):
    """GridMatmul.get_configs with an x by y thread block instead of the kernel's 16 x 16."""
    def get_configs(self, target):
        return dataclasses.replace(dl.gpu.Matmul.get_configs(self, target), block_size_x=x, block_size_y=y)

    return get_configs


def _stage_funcs():
    backend = backend_for("h100")
    program = prepared(import_onnx(_proto()), backend)
    kernel = backend._grid_kernel(program, program.stages, program.consumers(), "")
    return backend, transplant.selected_stages(kernel.func, tileable)


def test_the_trace_edit_leaves_the_init_split_to_the_kernel_and_replays_with_its_bindings():
    """The bindings stay while the trace replays (its shared-memory loads are placed over the block's
    threads) and become marks afterwards (transplant._bindings_as_marks)."""
    backend, stages = _stage_funcs()
    trace = transplant.dlight_stage_trace(stages[0].func, backend.target)
    original = [inst[0] for inst in trace.as_json(remove_postproc=False)[0]]
    launch_binds = sum(1 for inst in trace.as_json(remove_postproc=False)[0]
                       if inst[0] == "Bind" and str(inst[2][0]).startswith(transplant.LAUNCH_TAGS))
    edited, _ = transplant._unbound(trace)
    kinds = [inst[0] for inst in edited]
    assert "DecomposeReduction" in original and "DecomposeReduction" not in kinds
    assert "GetChildBlocks" in original and "GetChildBlocks" not in kinds
    assert launch_binds >= 4 and kinds.count("Bind") == original.count("Bind")


def test_transplanted_shared_loads_are_the_blocks_tiles_and_a_small_grid_takes_turns_over_them():
    """Replayed with its thread loops serial, a schedule's shared-memory loads covered one thread's part
    of the tile, indexed by that thread: rebound to the block's threads they loaded almost nothing the
    others read (BERT-base wrong on an H100; the CPU run, each thread loading its part itself, matched).
    Now no load reads a thread index that its own thread loops shadow, and on a grid of 8 blocks (an
    H100 of 2 SMs) every block takes turns over 3-4 tiles of each GEMM, split-K's partial one included,
    run phase by phase with the blocks and warps in a shuffled order."""
    proto = _proto()
    h100 = backend_for("h100")
    small = type(h100)(h100.target, dataclasses.replace(h100.spec, sms=2))
    program = prepared(import_onnx(proto), h100)
    assert any(op.name.endswith("_partial") for op in program.stages)
    kernels = small.fused_kernels(program, False)
    scheduled = schedule_kernels(kernels, small.default_scheduler())
    (func,) = scheduled.functions.values()
    assert func.attrs["souffle.grid_blocks"] == 8 and len(func.attrs["souffle.stage_schedules"]) == 5
    assert thread_aliased_blocks(func) == []
    model = run_phases_on_cpu(program, kernels, scheduled.functions, scheduled.function_of, reverse=True)
    feeds = model.random_feeds()
    expected = OnnxRuntimeModel(proto).run(feeds)
    for key, value in model.run(feeds).items():
        np.testing.assert_allclose(value, expected[key], rtol=RTOL, atol=ATOL)


def test_gemm_stages_keep_dlights_schedule_inside_the_grid_kernel():
    model = souffle_py.optimize(_proto(), target="h100")
    (call,) = model.plan.calls
    (launch,) = call.launches
    gemms = [int(stage.block[1:]) for stage in _stage_funcs()[1]]  # the Q/K/V, context, output, FFN GEMMs
    assert len(gemms) == 5 and [index for index, _ in launch.stage_schedules] == gemms
    assert {source for _, source in launch.stage_schedules} == {"dlight Matmul"}
    # dlight's 64 x 16 operand slices, rows padded to 18 floats against bank conflicts, shared by the stages
    assert launch.cooperative and launch.shared_bytes == 2 * 64 * 18 * 4
    assert f"5 GEMM stages on their own dlight Matmul schedules: {call.stages[gemms[0]]}, " in model.describe()
    source = model.device_source()
    assert "__syncthreads()" in source and "float2" in source  # dlight's vectorized tile loads
    assert syncs_in_divergent_code(source) == []
    binary, resources = nvcc.compile_cuda(source, ("sm_80", "sm_90"))
    assert binary and all(launch.kernel in resources[arch] for arch in ("sm_80", "sm_90"))


ONE_TILE = dict(layers=1, hidden=64, ffn=128, seq=64, heads=1)  # P.V and the output GEMM: one tile each


@pytest.mark.parametrize("variant,config", [("dlight", BERT_TILED), ("fewer-threads", BERT_TILED),
                                            ("grid-tile", BERT_TILED), ("dlight", ONE_TILE), ("grid-tile", ONE_TILE)])
def test_transplanted_stages_run_phase_by_phase_match_onnx_runtime(variant, config, monkeypatch):
    """dlight's schedule as the kernel runs it; with 128 threads (half the kernel's block, the rest guarded
    off, the shared-memory loads included); and grid.py's own tile where no stage schedule transplants.
    Softmax is computed in P.V's loads (a prologue). With one tile per GEMM, the blocks without a tile
    write nothing back (grid.guarded_tiles)."""
    if variant == "fewer-threads":
        monkeypatch.setattr(transplant.GridMatmul, "get_configs", _matmul_with_threads(8, 16))
    if variant == "grid-tile":
        monkeypatch.setattr("souffle_py.backends.cuda.schedule.stage_schedules", lambda *args: {})
    proto = build_model("bert", tiny=True, **config)
    backend = backend_for("h100")
    program = prepared(import_onnx(proto), backend)
    kernels = backend.fused_kernels(program, False)
    scheduled = schedule_kernels(kernels, backend.default_scheduler())
    prologues = 0
    for kernel, function in zip(kernels, scheduled.function_of):
        func = scheduled.functions[function]
        assert (func.attrs.get("souffle.stage_schedules") is None) == (variant == "grid-tile")
        assert thread_aliased_blocks(func) == []  # every shared load is the block's, not one thread's
        names = list(kernel.stages)
        softmax = next((i for i, name in enumerate(names) if name.endswith("softmax_softmax")), None)
        if softmax is not None and any(name.endswith("attn_context") for name in names):
            assert f'sblock("s{softmax}")' not in func.script()  # computed in P.V's shared-memory loads
            prologues += 1
    assert prologues == 1 or config is ONE_TILE
    model = run_phases_on_cpu(program, kernels, scheduled.functions, scheduled.function_of)
    feeds = model.random_feeds()
    expected = OnnxRuntimeModel(proto).run(feeds)
    for key, value in model.run(feeds).items():
        np.testing.assert_allclose(value, expected[key], rtol=RTOL, atol=ATOL)


def test_a_stage_schedule_with_more_threads_than_the_kernel_is_refused(monkeypatch, caplog):
    monkeypatch.setattr(transplant.GridMatmul, "get_configs", _matmul_with_threads(32, 16))
    with caplog.at_level("INFO"):
        model = souffle_py.optimize(_proto(), target="h100")
    (launch,) = model.plan.calls[0].launches
    assert launch.cooperative and launch.stage_schedules == ()  # grid.py's tile instead
    assert "uses 512 threads per block; a grid kernel has 256" in caplog.text


def test_tuned_stage_records_are_replayed_inside_the_grid_kernel(tmp_path):
    """The fastest record of each stage that transplants wins: a record with too many threads is passed
    over for the next one."""
    backend, stages = _stage_funcs()
    target = transplant.stage_target(backend.target)
    database = tuning.open_database(tmp_path, target)
    for stage in stages:
        for secs, schedule in ((1e-6, _wide_schedule(stage.func, target)),
                               (1e-5, _dlight_schedule(stage.func, backend.target))):
            tuning._commit(database, stage.func, schedule, [secs], target)
    model = souffle_py.optimize(_proto(), target="h100", database=tmp_path)
    (launch,) = model.plan.calls[0].launches
    assert len(launch.stage_schedules) == len(stages)
    assert {source for _, source in launch.stage_schedules} == {"tuned record"}


def _dlight_schedule(func, target):
    sch = s_tir.Schedule(tuning.workload(func))
    transplant.dlight_baseline(target)(sch)
    return sch


def _wide_schedule(func, target):
    """dlight's GEMM rule with a 32 x 32 thread block: more threads than a grid kernel has."""
    sch = s_tir.Schedule(tuning.workload(func))
    with target:
        rule = transplant.GridMatmul()
        rule.get_configs = lambda t: dataclasses.replace(dl.gpu.Matmul.get_configs(rule, t), block_size_x=32,
                                                         block_size_y=32)
        rule.apply(sch.mod["main"], target, False).trace.apply_to_schedule(sch, remove_postproc=False)
    return sch


def test_identical_gemm_stages_across_layers_are_one_tuning_task():
    backend = backend_for("h100")
    proto = build_model("bert", tiny=True, **{**BERT_TILED, "layers": 2})
    program = prepared(import_onnx(proto), backend)
    kernel = backend._grid_kernel(program, program.stages, program.consumers(), "")
    tasks = transplant.stage_tasks([kernel.func], lambda func: tileable)
    assert len(tasks) == 10 and len(tuning._distinct(tasks)) == 5  # 5 GEMMs per layer
    schedule = _dlight_schedule(next(iter(tasks.values())), backend.target)  # what a task is measured against
    assert any(inst.kind.name == "Bind" for inst in schedule.trace.insts)


def test_stage_schedules_survive_export_and_load(tmp_path):
    model = souffle_py.optimize(_proto(), target="h100")
    model.export(tmp_path / "bert.tar")
    loaded = souffle_py.load(tmp_path / "bert.tar")
    assert loaded.plan == model.plan and "GEMM stages on their own dlight Matmul schedules" in loaded.describe()


@pytest.mark.gpu
@pytest.mark.parametrize("name,config", [("bert", BERT_TILED),
                                         ("sbert", dict(layers=1, hidden=128, heads=2, ffn=256, seq=64, batch=2))])
def test_transplanted_stages_match_onnx_runtime_on_the_gpu(name, config):
    proto = build_model(name, tiny=True, **config)
    model = souffle_py.optimize(proto, target="cuda")
    assert any(launch.stage_schedules for call in model.plan.calls for launch in call.launches)
    feeds = model.random_feeds()
    expected = OnnxRuntimeModel(proto).run(feeds)
    for key, value in model.run(feeds).items():
        np.testing.assert_allclose(value, expected[key], rtol=RTOL, atol=ATOL)
