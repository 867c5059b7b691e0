"""The race detector flags a producer computed redundantly under a parallel loop into a shared buffer."""

from tvm import s_tir, te

from models.registry import build_model
from souffle_py.codegen.merge import merged_kernel
from souffle_py.frontend import import_onnx
from souffle_py.schedule.default import schedule_cpu
from souffle_py.schedule.races import parallel_write_races


def _two_stages():
    a = te.placeholder((8,), name="A")
    b = te.compute((8,), lambda j: a[j] * 2.0, name="B")
    c = te.compute((4, 8), lambda i, j: b[j] + i, name="C")
    return s_tir.Schedule(te.create_prim_func([a, c]))


def test_redundant_producer_under_a_parallel_loop_is_a_race():
    sch = _two_stages()
    i, _ = sch.get_loops(sch.get_sblock("C"))
    sch.parallel(i)
    sch.compute_at(sch.get_sblock("B"), i)  # every thread recomputes all of B into the shared buffer
    races = parallel_write_races(sch.mod["main"])
    assert len(races) == 1 and "block 'B' writes ['B']" in races[0]


def test_partitioned_parallel_writes_are_not_races():
    sch = _two_stages()
    i, _ = sch.get_loops(sch.get_sblock("C"))
    sch.parallel(i)
    j, = sch.get_loops(sch.get_sblock("B"))
    sch.parallel(j)
    assert parallel_write_races(sch.mod["main"]) == []


def test_default_schedules_of_merged_kernels_are_race_free():
    program = import_onnx(build_model("bert", tiny=True, layers=1))
    kernel = merged_kernel(program, program.stages, program.consumers(), "all")
    assert parallel_write_races(schedule_cpu(kernel.func)) == []
