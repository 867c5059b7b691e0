"""Grid-synchronized CUDA kernels (backends/cuda/grid.py) without a GPU: the partition, the generated
cooperative kernels and their grid barriers, nvcc, occupancy limits, and their semantics: the kernels run
on the CPU phase by phase (what the barriers guarantee) match ONNX Runtime, and a barrier stands wherever
the element-level analysis finds that a stage reads elements another thread wrote."""

import dataclasses
from math import prod

import numpy as np
import pytest
import tvm
from hypothesis import HealthCheck, given, settings

import souffle_py
from gpu_util import run_phases_on_cpu, syncs_in_divergent_code
from models.registry import MODEL_NAMES, build_model
from souffle_py.backends import backend_for
from souffle_py.backends.cuda import nvcc
from souffle_py.backends.cuda.barriers import GRID_SYNC, _is_sync
from souffle_py.backends.cuda.grid import grid_size
from souffle_py.backends.cuda.warps import MIN_WARP_TERMS
from souffle_py.baselines import OnnxRuntimeModel
from souffle_py.codegen.build import schedule_kernels
from souffle_py.errors import KernelFitError
from souffle_py.frontend import import_onnx
from souffle_py.partition import A100, H100
from souffle_py.ir.analysis import analyze
from te_passes.check import run_program
from souffle_py.passes import prepared, transformed
from test_vertical import dags
from tvm import te, tirx
import tvm_ffi

RTOL, ATOL = 1e-4, 1e-4


def _scheduled(program, kernels, backend):
    return schedule_kernels(kernels, backend.default_scheduler())


# --- partition and code ---------------------------------------------------------------------------------
# the LSTM: 2 layers x 5 steps as 6 wavefront steps, 2 barriers each, and one before and after the loop
@pytest.mark.parametrize("name,syncs", [("bert", 23), ("lstm", 14), ("mmoe", 7)])
def test_tiny_models_are_one_cooperative_kernel(name, syncs):
    model = souffle_py.optimize(build_model(name, tiny=True), target="h100")
    (call,) = model.plan.calls
    (launch,) = call.launches
    assert model.num_kernels == 1 and launch.cooperative and launch.grid_syncs == syncs
    assert launch.blocks <= H100.sms * launch.resident_blocks_per_sm
    source = model.device_source()
    assert "cooperative_groups" in source and source.count("grid_sync()") >= 1
    assert syncs_in_divergent_code(source) == []  # every thread reaches every barrier and shuffle
    assert launch.warp_reductions == source.count("= __shfl_down_sync(") // 5  # log2(32) shuffles each
    assert (f"{launch.warp_reductions} warp reductions" in model.describe()) == (launch.warp_reductions > 0)
    binary, resources = nvcc.compile_cuda(source, ("sm_80", "sm_90"))
    assert binary and all(launch.kernel in resources[arch] for arch in ("sm_80", "sm_90"))


BERT_TILED = dict(layers=1, hidden=256, ffn=1024, seq=128, heads=4)  # every GEMM divides into 64 x 64 tiles


def test_gemms_without_a_stage_schedule_run_in_grid_tiles_through_shared_memory(monkeypatch):
    """grid.py's own tile, for GEMM stages whose own schedules do not transplant (test_cuda_transplant.py
    has those that do)."""
    monkeypatch.setattr("souffle_py.backends.cuda.schedule.stage_schedules", lambda *args: {})
    model = souffle_py.optimize(build_model("bert", tiny=True, **BERT_TILED), target="h100")
    (call,) = model.plan.calls
    (launch,) = call.launches
    assert launch.cooperative and launch.shared_bytes == 2 * 64 * 16 * 4  # one A and one W slice, reused
    assert "__shared__" in model.device_source() and "__syncthreads()" in model.device_source()


def test_an_lstm_wavefront_step_is_one_grid_barrier_when_its_gates_are_warp_reductions():
    """A unit's four gates in one warp, its cell update after them in that warp behind a __syncwarp: one
    barrier per wavefront step (T + L - 1 = 6), one before the loop and one after it."""
    model = souffle_py.optimize(build_model("lstm", tiny=True, **LSTM_WARP_GATES), target="h100")
    (launch,) = model.plan.calls[0].launches
    assert launch.grid_syncs == (4 + 3 - 1) + 2 and launch.warp_reductions == 3 + 1  # + the first input projection
    assert "__syncwarp" in model.device_source()


def test_gemms_that_are_not_whole_tiles_join_the_grid_kernel_padded_to_them():
    """200 rows: the large GEMMs take dlight's schedule (padded to whole tiles) inside the grid kernel
    (grid_stages.py), where they kept tiled kernels of their own; the 41 MFLOP output projection stays in
    the launch nest (a thread per output). A large contraction that nothing schedules as a stage
    (a grouped conv) still keeps a kernel of its own: test_cuda_grid_stages.py."""
    proto = build_model("bert", tiny=True, layers=1, hidden=320, ffn=1280, seq=200, heads=4)  # 200 rows
    model = souffle_py.optimize(proto, target="h100")
    (call,) = model.plan.calls
    (launch,) = call.launches
    assert launch.cooperative and call.reason == "program start"
    assert [call.stages[i] for i, _ in launch.stage_schedules] == [
        "layer0_attn_k_matmul_h3", "layer0_ffn_fc1_matmul", "layer0_ffn_fc2_matmul"]


def test_without_grid_sync_the_same_stages_are_separate_launches():
    proto = build_model("mmoe", tiny=True)
    merged = souffle_py.optimize(proto, target="h100")
    separate = souffle_py.optimize(proto, target="h100", grid_sync=False)
    assert [s for c in separate.plan.calls for s in c.stages] == list(merged.plan.calls[0].stages)
    assert not any(l.cooperative for c in separate.plan.calls for l in c.launches)


def test_the_grid_fits_one_wave_of_the_gpu():
    program = import_onnx(build_model("bert", tiny=True, **BERT_TILED))
    kernel = backend_for("a100")._grid_kernel(program, program.stages, program.consumers(), "")
    largest = max(int(np.prod([int(d) for d in op.output(0).shape])) for op in program.stages)  # 128 x 1024
    assert largest // 256 > A100.sms * 4  # more work than one wave: the grid is the wave
    assert grid_size(kernel.func, A100, threads=256, registers=64) == (A100.sms * 4, 4)
    assert grid_size(kernel.func, A100, threads=256, registers=32) == (A100.sms * 8, 8)
    assert grid_size(kernel.func, A100, threads=256, registers=255) == (A100.sms, 1)  # one wave: 108 blocks


def test_a_small_grid_has_threads_for_every_stage_at_once():
    """Below a wave, the grid has a thread per output of every stage (independent stages share a phase)
    and a warp per output of a warp-reduced one."""
    x = te.placeholder((1000, 128), name="x")
    k = te.reduce_axis((0, 128), name="k")
    rows = te.compute((1000,), lambda i: te.sum(x[i, k], axis=k), name="rows")      # 1000 warps
    doubled = te.compute((1000, 128), lambda i, j: x[i, j] * 2.0, name="doubled")   # 128000 threads
    func = te.create_prim_func([x, rows, doubled])
    assert grid_size(func, H100, threads=256, registers=32)[0] == (1000 * 32 + 1000 * 128) // 256


def test_a_grid_larger_than_the_present_gpu_is_refused_before_launch():
    model = souffle_py.optimize(build_model("mmoe", tiny=True), target="h100")

    class SmallGpu:
        multi_processor_count = 1

    (call,) = model.plan.calls
    assert call.launches[0].cooperative
    big = dataclasses.replace(call.launches[0], blocks=9, resident_blocks_per_sm=8)
    model.plan = dataclasses.replace(model.plan, calls=(dataclasses.replace(call, launches=(big,)),))
    with pytest.raises(KernelFitError, match="grid-synchronized launch of 9 blocks"):
        model._check_grids(SmallGpu())


# --- semantics ------------------------------------------------------------------------------------------
LSTM_WARP_GATES = dict(layers=3, steps=4, hidden=64, input=64)  # gates reduce over 64+ terms: warps
SBERT_TILED = dict(layers=1, hidden=128, heads=2, ffn=256, seq=64, batch=2)  # batched, masked, tiled GEMMs
VARIANTS = {"bert-tiled": ("bert", BERT_TILED), "sbert-tiled": ("sbert", SBERT_TILED), "lstm-3-layers": ("lstm", dict(layers=3, steps=4)),
            "lstm-unfused-passes": ("lstm", dict(layers=3)), "lstm-warp-gates": ("lstm", LSTM_WARP_GATES)}


@pytest.mark.parametrize("name", [*MODEL_NAMES, *VARIANTS])
def test_grid_kernels_run_phase_by_phase_match_onnx_runtime(name, caplog):
    """Shared-memory tiles included (bert-tiled, sbert-tiled: GEMM stages on dlight's schedules, transplanted):
    serialized, each thread loads the whole tile itself.
    Blocks and warps run in a shuffled order within each phase (gpu_util: the GPU gives them none):
    sbert's norm, written by one warp and read by the next without a barrier, and computed again by every
    warp from a sum only warp 0 had (1.8e12 off on an H100), matched in program order and does not here.
    The LSTMs run as a layer x time wavefront (backend.restructure), with and without the TE passes.
    No grid kernel falls back to separate launches (a schedule TVM refused)."""
    model_name, config = VARIANTS.get(name, (name, {}))
    proto = build_model(model_name, tiny=True, **config)
    backend = backend_for("h100")
    passes = "none" if name == "lstm-unfused-passes" else "all"
    program = prepared(import_onnx(proto), backend, passes)
    with caplog.at_level("WARNING"):
        kernels = backend.fused_kernels(program, False)
    assert "run as separate kernels" not in caplog.text
    scheduled = _scheduled(program, kernels, backend)
    model = run_phases_on_cpu(program, kernels, scheduled.functions, scheduled.function_of, reverse=True)
    feeds = model.random_feeds()
    expected = OnnxRuntimeModel(proto).run(feeds)
    for key, value in model.run(feeds).items():
        np.testing.assert_allclose(value, expected[key], rtol=RTOL, atol=ATOL)


def _without_barriers(func):
    def drop(seq):
        kept = [s for s in seq.seq if not (isinstance(s, tirx.Evaluate) and getattr(getattr(s.value, "op", None), "name", "") == GRID_SYNC)]
        return kept[0] if len(kept) == 1 else tirx.SeqStmt(kept)

    return tvm_ffi.structural_map(func, [(tirx.SeqStmt, drop)])


def test_the_cpu_run_sees_a_missing_barrier():
    """The check above is not vacuous: without its barriers the LSTM kernel computes something else."""
    proto = build_model("lstm", tiny=True)
    backend = backend_for("h100")
    program = prepared(import_onnx(proto), backend)
    kernels = backend.fused_kernels(program, False)
    scheduled = _scheduled(program, kernels, backend)
    stripped = {n: _without_barriers(f) for n, f in scheduled.functions.items()}
    model = run_phases_on_cpu(program, kernels, stripped, scheduled.function_of, phases=False)
    feeds = model.random_feeds()
    expected = OnnxRuntimeModel(proto).run(feeds)
    assert not all(np.allclose(v, expected[k], rtol=RTOL, atol=ATOL) for k, v in model.run(feeds).items())


def _stage_positions(func):
    """Stage index -> position of its statement under the grid's thread loop, and the barrier positions."""
    positions, barriers = {}, []

    def visit(loop):
        if loop.thread_binding is None or str(loop.thread_binding.thread_tag) != "threadIdx.y":
            return
        stmts = list(loop.body.seq) if isinstance(loop.body, tirx.SeqStmt) else [loop.body]
        for i, stmt in enumerate(stmts):
            if _is_sync(stmt):
                barriers.append(i)
            names = []
            tvm_ffi.structural_walk(stmt, [(tvm.s_tir.stmt.SBlockRealize, lambda r: names.append(r.block.name_hint))])
            for name in names:
                if name.startswith("s"):
                    positions.setdefault(int(name[1:].split("_")[0]), i)

    tvm_ffi.structural_walk(func.body, [(tirx.For, visit)])
    return positions, barriers


def _reads_own_elements(access, consumer, tensor) -> bool:
    """Whether every element of `consumer` reads only elements of `tensor` with its own row-major flat
    index: in a grid kernel both are then computed by the same thread (element e of every stage goes to
    thread e % threads of block (e // threads) % blocks)."""
    import islpy as isl

    if consumer.reduce_axis and not (_warp_reduces(consumer) and _warp_reduces(tensor.op)):
        return False  # a warp per output reads a warp-reduced output where its lane 0 wrote it (__syncwarp)

    def flat(names, shape):
        terms, stride = [], 1
        for name, extent in reversed(list(zip(names, shape))):
            terms.append(f"{stride} * {name}")
            stride *= extent
        return " + ".join(terms) or "0"

    out_shape = [int(d) for d in consumer.output(0).shape]
    in_shape = [int(d) for d in tensor.shape]
    v = [f"v{n}" for n in range(len(out_shape))]
    w = [f"w{n}" for n in range(len(in_shape))]
    same = isl.Map(f"{{ {consumer.name}[{', '.join(v)}] -> {tensor.op.name}[{', '.join(w)}] : "
                   f"{flat(v, out_shape)} = {flat(w, in_shape)} }}")
    return access.is_subset(same)


def _warp_reduces(op) -> bool:
    return bool(getattr(op, "reduce_axis", None)) and \
        prod(int(r.dom.extent) for r in op.reduce_axis) >= MIN_WARP_TERMS


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dags())
def test_random_programs_barriers_follow_the_element_level_dependences(program):
    """Random TE programs as one grid kernel: a barrier separates every producer and consumer unless the
    consumer reads exactly the element of its own index (same shape, identity map: the same thread wrote
    it); run phase by phase on the CPU, the kernel equals the unfused program."""
    backend = backend_for("h100")
    stages = program.stages
    kernel = backend._grid_kernel(program, stages, program.consumers(), "", blocks=2)
    scheduled = schedule_kernels([kernel], backend.default_scheduler())
    (func,) = scheduled.functions.values()
    positions, barriers = _stage_positions(func)
    analysis = analyze(program)
    index = {op.name: i for i, op in enumerate(stages)}
    for j, consumer in enumerate(stages):
        for tensor in consumer.input_tensors:
            if tensor.op.name not in index:
                continue
            i = index[tensor.op.name]
            own = _reads_own_elements(analysis.access(consumer.name, tensor.op.name), consumer, tensor)
            separated = any(positions[i] < b < positions[j] for b in barriers)
            assert separated or own, f"{consumer.name} reads {tensor.op.name} without a barrier"
    model = run_phases_on_cpu(program, [kernel], scheduled.functions, scheduled.function_of)
    feeds = program.random_feeds(seed=2)
    expected = run_program(program, feeds)
    for key, value in model.run(feeds).items():
        np.testing.assert_allclose(value, expected[key], rtol=1e-5, atol=1e-5)


def test_split_reductions_run_phase_by_phase_match_the_unsplit_program():
    """Split-K inside a grid kernel (backends/cuda/split_k.py): layer-norm-like rows (interleaved parts) and
    a GEMM of 4 tiles (contiguous parts, tiled through shared memory) equal the unsplit program."""
    from souffle_py.backends.cuda.split_k import split_for
    from souffle_py.ir.program import TEProgram
    from te_passes.split_reduction import Split, split_reductions
    from tvm import te

    x = te.placeholder((128, 1024), "float32", name="x")
    w = te.placeholder((1024, 128), "float32", name="w")
    k = te.reduce_axis((0, 1024), name="k")
    gemm = te.compute((128, 128), lambda i, j: te.sum(x[i, k] * w[k, j], axis=k), name="gemm")
    r = te.reduce_axis((0, 1024), name="r")
    columns = te.compute((128,), lambda j: te.sum(w[r, j] * w[r, j], axis=r), name="columns")  # a thread each
    out = te.compute((128, 128), lambda i, j: gemm[i, j] * columns[j], name="out")
    rng = np.random.default_rng(0)
    program = TEProgram(inputs={"x": x}, params={"w": rng.standard_normal((1024, 128)).astype("float32")},
                        param_tensors={"w": w}, outputs={"out": out})
    decisions = {op.name: split_for(op, H100) for op in program.stages if op.reduce_axis}
    assert decisions == {"gemm": Split(4, contiguous=True), "columns": Split(32)}
    split = split_reductions(program, lambda op: split_for(op, H100))
    backend = backend_for("h100")
    kernel = backend._grid_kernel(split, split.stages, split.consumers(), "")
    scheduled = schedule_kernels([kernel], backend.default_scheduler())
    model = run_phases_on_cpu(split, [kernel], scheduled.functions, scheduled.function_of)
    feeds = program.random_feeds()
    expected = run_program(program, feeds)["out"]  # sums in another order: rounding relative to the magnitude
    np.testing.assert_allclose(model.run(feeds)["out"], expected, rtol=0, atol=1e-5 * np.abs(expected).max())


def test_stages_of_one_phase_read_in_their_own_thread_share_one_rotation():
    """Two independent stages of one phase, both read by a third in its own thread: the three keep one
    block rotation (spread_phases), or the third would read the second's elements from another block
    before they are written (the phase-by-phase CPU run sees it)."""
    from souffle_py.ir.program import TEProgram
    from tvm import te

    x = te.placeholder((256,), "float32", name="x")
    a = te.compute((256,), lambda i: x[i] + 1.0, name="a")
    d = te.compute((256,), lambda i: x[i] * 2.0, name="d")
    c = te.compute((256,), lambda i: a[i] + d[i], name="c")
    program = TEProgram(inputs={"x": x}, params={}, param_tensors={}, outputs={"c": c})
    backend = backend_for("h100")
    kernel = backend._grid_kernel(program, program.stages, program.consumers(), "", blocks=4)
    scheduled = schedule_kernels([kernel], backend.default_scheduler())
    (func,) = scheduled.functions.values()
    assert GRID_SYNC not in func.script()  # one phase: every read is of the thread's own element
    model = run_phases_on_cpu(program, [kernel], scheduled.functions, scheduled.function_of)
    feeds = program.random_feeds()
    np.testing.assert_allclose(model.run(feeds)["c"], (feeds["x"] + 1) + feeds["x"] * 2, rtol=1e-6)
