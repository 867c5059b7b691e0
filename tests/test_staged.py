"""Tuned stages inside merged CPU kernels (schedule/stages.py, schedule/staged.py): extraction under canonical
names, the default schedule competing as a record, replay inside the merged kernel, racy records rejected."""

from __future__ import annotations

import re
import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import s_tir, te
from tvm.s_tir import meta_schedule as ms

from souffle_py.schedule import tuning
from souffle_py.schedule.rules import gemm_panel as default_rules
from souffle_py.schedule.default import schedule_cpu
from souffle_py.schedule.races import parallel_write_races
from souffle_py.schedule.staged import default_stage_schedule, schedule_with_records, stage_tasks, staged_scheduler
from souffle_py.schedule.stages import STAGE, compute_stages, replay, replay_json
from souffle_py.target import resolve_target

TARGET = resolve_target("llvm")


@pytest.fixture(scope="module")
def bert_kernels():
    """The merged kernels of a two-layer tiny BERT (one kernel holding both layers)."""
    from models.registry import build_model
    from souffle_py.backends import backend_for
    from souffle_py.frontend import load_model, lower
    from souffle_py.passes import prepared, transformed

    backend = backend_for("llvm")
    program, _ = transformed(lower(load_model(build_model("bert", tiny=True, layers=2))))
    return backend.fused_kernels(prepared(program, backend, "-vertical,-horizontal", merge=False), fast_math=True)


def gemm_then_relu(m=16, k=32, n=64) -> tvm.tirx.PrimFunc:
    a = te.placeholder((m, k), name="A")
    b = te.placeholder((k, n), name="B")
    r = te.reduce_axis((0, k), name="k")
    c = te.compute((m, n), lambda i, j: te.sum(a[i, r] * b[r, j], axis=r), name="C")
    d = te.compute((m, n), lambda i, j: te.max(c[i, j], 0.0), name="D")
    return te.create_prim_func([a, b, d])


def commit(database, func, sch, seconds: float) -> None:
    """A tuning record of `func` (a stage) with the trace of `sch` and a made-up run time."""
    mod = tuning.workload(func)
    database.commit_tuning_record(ms.database.TuningRecord(
        sch.trace, database.commit_workload(mod), [seconds], TARGET, ms.arg_info.ArgInfo.from_prim_func(func)))


def marked_schedule(stage_func) -> s_tir.Schedule:
    """A recognizable schedule of a stage: the outer loop split by 2 and annotated."""
    sch = s_tir.Schedule(tuning.workload(stage_func))
    block = sch.get_sblock(STAGE)
    outer, _ = sch.split(sch.get_loops(block)[0], [2, None])
    sch.annotate(outer, "souffle_test_mark", 1)
    return sch


def marks(func) -> list[str]:
    found = []
    tvm_ffi.structural_walk(func.body, [(tvm.tirx.For, lambda f: found.extend(
        str(k) for k in f.annotations.keys() if str(k) == "souffle_test_mark"))])
    return found


def run(func, *arrays):
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=TARGET)
    dev = tvm.cpu()
    args = [tvm.runtime.tensor(a, dev) for a in arrays]
    out = tvm.runtime.empty((arrays[0].shape[0], arrays[1].shape[1]), "float32", dev)
    lib["main"](*args, out)
    return out.numpy()


def test_stages_are_extracted_under_canonical_names(bert_kernels):
    stages = [s for k in bert_kernels for s in compute_stages(k.func)]
    assert len(stages) == 12  # per layer: QKV, two attention batch matmuls, output projection, two FFN GEMMs
    for stage in stages:
        sch = s_tir.Schedule(stage.func)
        assert [sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root"))] == [STAGE]
    # the second layer's stages are the first layer's: six tasks, each weighing two calls
    groups = tuning._distinct(stage_tasks(bert_kernels))
    assert [len(g) for g in groups] == [2] * 6


def test_elementwise_stages_are_not_tuned():
    assert [s.block for s in compute_stages(gemm_then_relu())] == ["C"]


def test_a_replayed_record_is_applied_inside_the_merged_kernel(tmp_path):
    func = gemm_then_relu()
    stage = compute_stages(func)[0]
    database = tuning.open_database(tmp_path, TARGET)
    commit(database, stage.func, marked_schedule(stage.func), 1e-6)
    scheduled = staged_scheduler(tmp_path, TARGET)(func)
    assert marks(scheduled) == ["souffle_test_mark"]
    # the replayed stage keeps its split; the ReLU still gets its default (parallel-free at this size) rule
    sch = s_tir.Schedule(scheduled)
    assert [int(sch.get(l).extent) for l in sch.get_loops(sch.get_sblock("C"))][0] == 2
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((16, 32)).astype("float32"), rng.standard_normal((32, 64)).astype("float32")
    np.testing.assert_allclose(run(scheduled, a, b), np.maximum(a @ b, 0), rtol=1e-5, atol=1e-5)


def test_replay_names_the_blocks_a_trace_derives_from_the_stage(bert_kernels):
    """The default GEMM trace makes 'stage_local' and 'stage_init' blocks: inside the kernel they are named
    after the stage's block, and the kernel is the default-scheduled kernel for that stage."""
    kernel = bert_kernels[0]
    stage = compute_stages(kernel.func)[3]
    sch = s_tir.Schedule(tuning.workload(stage.func))
    default_stage_schedule(sch)
    merged = s_tir.Schedule(kernel.func)
    original = [merged.get(b).name_hint for b in merged.get_child_blocks(merged.get_sblock("root"))]
    replay(merged, stage.block, sch.trace)
    names = {merged.get(b).name_hint for b in merged.get_child_blocks(merged.get_sblock("root"))}
    assert {f"{stage.block}_local", f"{stage.block}_init"} <= names
    rest = schedule_cpu(merged.mod["main"], [n for n in original if n != stage.block])
    # the same code as the default schedule of the whole kernel, up to the order of the local allocations
    assert sorted(rest.script().splitlines()) == sorted(schedule_cpu(kernel.func).script().splitlines())


def blocked_conv_then_relu(channels=64, filters=32, size=8) -> tvm.tirx.PrimFunc:
    """A 3x3 conv over channel blocks ([1, C/32, H+2, W+2, 32] -> [1, F/32, H, W, 32]) and its ReLU."""
    x = te.placeholder((1, channels // 32, size + 2, size + 2, 32), name="x")
    w = te.placeholder((filters // 32, channels, 3, 3, 32), name="w")
    rc, r0, r1 = te.reduce_axis((0, channels), "rc"), te.reduce_axis((0, 3), "r0"), te.reduce_axis((0, 3), "r1")
    y = te.compute((1, filters // 32, size, size, 32), lambda n, cb, i, j, ci: te.sum(
        x[0, rc // 32, i + r0, j + r1, rc % 32] * w[cb, rc, r0, r1, ci], axis=[rc, r0, r1]), name="conv")
    z = te.compute(y.shape, lambda *i: te.max(y(*i), 0.0), name="relu")
    return te.create_prim_func([x, w, z])


def test_a_stage_trace_replays_where_the_stage_has_readers():
    """On the stage alone the conv's write-back asks for its consumers (to fuse an epilogue) and finds none;
    in the kernel it finds the ReLU. That query is dropped on replay: TVM refused the whole trace for the
    changed count, and every conv with a reader kept its default, whatever its measured variants said."""
    func = blocked_conv_then_relu()
    stage = compute_stages(func)[0]
    sch = s_tir.Schedule(tuning.workload(stage.func))
    default_stage_schedule(sch)
    assert any(inst.kind.name == "GetConsumers" for inst in sch.trace.insts)
    merged = s_tir.Schedule(func)
    replay(merged, stage.block, sch.trace)
    names = {merged.get(b).name_hint for b in merged.get_child_blocks(merged.get_sblock("root"))}
    assert f"{stage.block}_local" in names


def test_a_record_made_for_another_structure_does_not_apply():
    """A recorded instruction that finds another number of loops (or neighbours) inside the kernel than on
    the stage alone makes TVM refuse the replay: the record does not apply there (RuleDoesNotApply, the
    next record or the default rules), not a failure (a tuned trace of a tiny model failed `make test`)."""
    from souffle_py.failures import RuleDoesNotApply

    func = blocked_conv_then_relu()
    stage = compute_stages(func)[0]
    loops = len(s_tir.Schedule(func).get_loops(stage.block))
    recorded = [[["GetSBlock", [], [STAGE, "main"], ["b0"]],
                 ["GetLoops", ["b0"], [], [f"l{i}" for i in range(loops + 1)]]], []]
    with pytest.raises(RuleDoesNotApply, match="another number of blocks or loops"):
        replay_json(s_tir.Schedule(func), stage.block, recorded)


def test_the_faster_record_wins_and_the_default_can_be_it(tmp_path, monkeypatch):
    """The default's record, the faster, is replayed: the default schedule, but for the epilogue, which the
    default rules fuse into the GEMM's write-back in the kernel and a stage's trace (the stage alone has no
    reader) cannot."""
    monkeypatch.setattr(default_rules, "GEMM_EPILOGUE", False)  # the comparison's default: epilogue apart
    func = gemm_then_relu()
    stage = compute_stages(func)[0]
    database = tuning.open_database(tmp_path, TARGET)
    default = s_tir.Schedule(tuning.workload(stage.func))
    default_stage_schedule(default)
    commit(database, stage.func, default, 1e-6)
    commit(database, stage.func, marked_schedule(stage.func), 2e-6)  # slower than the default
    scheduled = schedule_with_records(func, database)
    assert not marks(scheduled)
    assert tvm_ffi.structural_equal(scheduled, schedule_cpu(func))


def racy_schedule(stage_func) -> s_tir.Schedule:
    """The GEMM's rows in parallel, each row copying all of B into one shared buffer: a write race."""
    sch = s_tir.Schedule(tuning.workload(stage_func))
    block = sch.get_sblock(STAGE)
    i = sch.get_loops(block)[0]
    cache = sch.cache_read(block, 1, "global")
    sch.compute_at(cache, i)
    sch.parallel(i)
    return sch


def test_a_racy_candidate_fails_the_search_postprocessor():
    stage = compute_stages(gemm_then_relu())[0]
    racy = racy_schedule(stage.func)
    assert parallel_write_races(racy.mod["main"])
    assert tuning.RejectRaces().apply(racy) is False
    clean = s_tir.Schedule(tuning.workload(stage.func))
    default_stage_schedule(clean)
    assert tuning.RejectRaces().apply(clean) is True
    # the CPU search runs it after MetaSchedule's own postprocessors
    postprocs = tuning._space_generator(TARGET).postprocs
    assert len(postprocs) == len(ms.Postproc.create("llvm")) + 1 and "PyPostproc" in type(postprocs[-1]).__name__


def test_a_racy_record_is_not_replayed(tmp_path):
    func = gemm_then_relu()
    stage = compute_stages(func)[0]
    database = tuning.open_database(tmp_path, TARGET)
    commit(database, stage.func, racy_schedule(stage.func), 1e-7)  # fastest, and racy
    scheduled = schedule_with_records(func, database)
    assert not parallel_write_races(scheduled)
    assert tvm_ffi.structural_equal(scheduled, schedule_cpu(func))


def _record_lines(database_dir) -> int:
    records = tuning.database_path(database_dir, TARGET) / "database_tuning_record.json"
    return len(records.read_text().splitlines()) if records.exists() else 0


def tiny_mlp():
    """x @ W1 + b -> Relu -> @ W2: one merged kernel with two GEMM stages (two tuning tasks)."""
    import onnx
    from onnx import helper, numpy_helper

    from models.common import IR_VERSION

    rng = np.random.default_rng(0)
    consts = {"w1": rng.standard_normal((32, 64)), "b1": rng.standard_normal(64), "w2": rng.standard_normal((64, 32))}
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Add", ["h", "b1"], ["hb"]),
             helper.make_node("Relu", ["hb"], ["r"]), helper.make_node("MatMul", ["r", "w2"], ["y"])]
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, (16, 32))],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, (16, 32))],
        [numpy_helper.from_array(v.astype("float32"), n) for n, v in consts.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=IR_VERSION)


def test_second_compile_tunes_nothing_and_gives_the_same_schedules(tmp_path, capsys):
    """optimize(trials=N) on a merged kernel: each stage's default is measured and a few trials run; a second
    compile with the database measures nothing and schedules the kernel the same way."""
    import souffle_py
    from souffle_py.baselines import OnnxRuntimeModel

    proto = tiny_mlp()
    first = souffle_py.optimize(proto, trials=2, database=tmp_path)
    out = capsys.readouterr().out
    assert first.num_kernels == 1 and "2 to tune" in out
    assert len(re.findall(r"default schedule \d", out)) == 2  # measured before the search
    assert out.count("measured again back to back") == 2  # the default against the best candidates, after it
    recorded = _record_lines(tmp_path)
    assert recorded >= 3  # the two defaults and at least one candidate, as measured back to back
    before = [staged_scheduler(tmp_path, TARGET)(k.func) for k in first.kernels]
    second = souffle_py.optimize(proto, trials=2, database=tmp_path)
    assert "0 to tune" in capsys.readouterr().out
    assert _record_lines(tmp_path) == recorded
    after = [staged_scheduler(tmp_path, TARGET)(k.func) for k in second.kernels]
    assert all(tvm_ffi.structural_equal(x, y) for x, y in zip(before, after))
    feeds = second.random_feeds()
    expected = OnnxRuntimeModel(proto).run(feeds)
    for model in (first, second):
        for name, value in model.run(feeds).items():
            np.testing.assert_allclose(value, expected[name], rtol=1e-4, atol=1e-4)


def test_a_stage_whose_default_streams_its_weights_is_not_tuned(tmp_path, capsys):
    """Few rows over 1 MB of packed weights: the default streams them, no search runs, no record is made,
    and the stage keeps its default schedule (tuning.py)."""
    a_t = te.placeholder((128, 256), name="a")
    w_t = te.placeholder((32, 256, 32), name="w")
    k = te.reduce_axis((0, 256), name="k")
    c_t = te.compute((128, 1024), lambda i, j: te.sum(a_t[i, k] * w_t[j // 32, k, j % 32], axis=k), name="stage")
    func = te.create_prim_func([a_t, w_t, c_t])
    tuned = tuning.tune({"gemm": func}, TARGET, tmp_path, trials=8, baseline=default_stage_schedule)
    assert tuned == {}
    assert "1 keeping a default that streams its weights" in capsys.readouterr().out
    assert _record_lines(tmp_path) == 0
