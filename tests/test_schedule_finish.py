"""schedule/finish.py: a schedule's marks are lowered both where a model is built and where MetaSchedule's
builder measures a schedule (tuning.py), so that a measured variant is the code that runs."""

import re

import tvm
import tvm_ffi
from tvm import s_tir, te

from souffle_py.codegen.stack_locals import PIPELINE
from souffle_py.schedule import tuning
from souffle_py.schedule.blocks import has_annotated_loop
from souffle_py.schedule.default import schedule_blocks, schedule_cpu
from souffle_py.schedule.finish import finish_schedule
from souffle_py.schedule.ragged import LAST_TILE_APART
from souffle_py.target import resolve_target
from tests.test_schedule_conv import _blocked_pointwise

TARGET = resolve_target("llvm")


def _ragged_conv_schedule() -> s_tir.Schedule:
    """A 32-channel 1x1 conv over 28 columns: 6 columns x 2 blocks, its last column tile masked (marked
    LAST_TILE_APART by the default rules, cut apart by finish_schedule)."""
    tensors, _ = _blocked_pointwise(128, 128, 28, 32)
    sch = s_tir.Schedule(te.create_prim_func(tensors))
    schedule_blocks(sch, ["conv"])
    return sch


def test_finishing_lowers_the_marks_and_leaves_unmarked_functions_alone():
    func = _ragged_conv_schedule().mod["main"]
    finished = finish_schedule(func)
    assert has_annotated_loop(func, LAST_TILE_APART)
    assert not has_annotated_loop(finished, LAST_TILE_APART)
    assert finish_schedule(finished).same_as(finished)  # nothing left to lower: the function itself


def _ir(library) -> str:
    """A built library's LLVM IR without the buffer addresses it names in its alias metadata."""
    return re.sub(r"0x[0-9a-f]+", "", library.inspect_source("ll"))


def test_the_tuning_builder_measures_the_code_the_model_runs():
    """The builder's library is the one built from the finished function (schedule_cpu's), not from the
    marked schedule: measured without the marks lowered, a conv's masked tile kept its predicate in every
    tile and timed 1.5x slower than it runs."""
    sch = _ragged_conv_schedule()
    finished = finish_schedule(sch.mod["main"])
    measured = tuning._build_function()(sch.mod, TARGET, None)
    built = tvm.compile(tvm.IRModule({"main": finished}), target=TARGET, tir_pipeline=PIPELINE).mod
    unfinished = tvm.compile(sch.mod, target=TARGET, tir_pipeline=PIPELINE).mod
    assert _ir(measured) == _ir(built)
    assert _ir(measured) != _ir(unfinished)
    tensors, _ = _blocked_pointwise(128, 128, 28, 32)
    assert tvm_ffi.structural_equal(schedule_cpu(te.create_prim_func(tensors)), finished)
