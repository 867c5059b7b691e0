"""Tuned stages inside merged CPU kernels: tune each compute-intensive stage alone, replay the winner inside.

1. Every GEMM/conv stage of every kernel call is a task (stages.py cuts it out under canonical names, so
   BERT's twelve layers give one task per distinct GEMM, weighted by its calls).
2. Before the search, the stage's default schedule (schedule/default.py) is measured by MetaSchedule's own
   builder and runner and seeds the search; after it, the default and the best candidates are measured
   again back to back and only those records count (tuning.tune's `baseline`), so a task's best record is
   min(default, tuned) and a small budget no longer makes a kernel slower by much more than the noise.
   Racy candidates never get a record (the RejectRaces postprocessor of tuning.py).
3. Scheduling a kernel: each stage's best trace is replayed on its block (postprocessing included), the
   other blocks get their default schedules, and the result is checked for races once more; a stage whose
   replay fails or races tries the next record, then keeps its default.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Callable, Sequence

import tvm
from tvm import s_tir, tirx

from souffle_py.codegen.kernels import Kernel
from souffle_py.failures import not_applied
from souffle_py.schedule import tuning
from souffle_py.schedule.default import schedule_blocks, schedule_cpu
from souffle_py.schedule.races import parallel_write_races
from souffle_py.schedule.stages import STAGE, compute_stages, replay
from souffle_py.schedule.variants import variants_dir

log = logging.getLogger(__name__)


def stage_tasks(kernels: Sequence[Kernel]) -> dict[str, tirx.PrimFunc]:
    """Every compute-intensive stage of every kernel call, by "kernel.block" (tune() groups equal ones)."""
    return {f"{kernel.name}.{stage.block}": stage.func for kernel in kernels for stage in compute_stages(kernel.func)}


def tune_stages(kernels: Sequence[Kernel], target: tvm.target.Target, database_dir: str | os.PathLike, trials: int,
                quiet: bool = False, runner=None) -> None:
    """Measure the default schedule of each untuned stage, then spend `trials` on those stages (measured
    on the RPC tracker `runner`'s servers when given)."""
    tuning.tune(stage_tasks(kernels), target, database_dir, trials, quiet=quiet, baseline=default_stage_schedule,
                runner=runner)


def default_stage_schedule(sch: s_tir.Schedule) -> None:
    """The default schedule of an extracted stage, recorded by block name so that its trace replays."""
    schedule_blocks(sch, [STAGE])


def staged_scheduler(database_dir: str | os.PathLike, target: tvm.target.Target,
                     one_thread: bool = False, extra=()) -> Callable[[tirx.PrimFunc], tirx.PrimFunc]:
    """A schedule function for build_kernels: recorded stages replayed, default schedules elsewhere
    (one_thread: on one thread, schedule_cpu); `extra` databases are consulted last (this compile's
    provisional variant choices, variants.py)."""
    databases = [tuning.open_database(folder, target, create=False)
                 for folder in (database_dir, variants_dir(database_dir))]  # tuned records first (variants.py)
    databases = [database for database in [*databases, *extra] if database is not None]
    if not databases:
        return functools.partial(schedule_cpu, one_thread=one_thread)

    def schedule(func: tirx.PrimFunc) -> tirx.PrimFunc:
        return schedule_with_records(func, databases, one_thread)

    return schedule


def schedule_with_records(func: tirx.PrimFunc, database, one_thread: bool = False) -> tirx.PrimFunc:
    """`func` with its compute-intensive stages scheduled by their best race-free records (`database`: one,
    or several consulted in order: the first with records for a stage counts), the rest by the default
    rules."""
    databases = database if isinstance(database, (list, tuple)) else [database]
    sch = s_tir.Schedule(func)
    names = [sch.get(block).name_hint for block in sch.get_child_blocks(sch.get_sblock("root"))]
    replayed = set()
    for stage in compute_stages(func):
        traces = next((t for t in (tuning.best_traces(d, stage.func) for d in databases) if t), [])
        for trace in traces:
            attempt = sch.copy()
            try:
                replay(attempt, stage.block, trace)
            except Exception as exc:  # noqa: BLE001  (a record of another TVM version, say: the next, or the default)
                not_applied("a tuning record", stage.block, exc, "the next record, or the default schedule")
                continue
            races = parallel_write_races(attempt.mod["main"])
            if races:
                log.debug("record for %s rejected: %s", stage.block, races[0])
                continue
            sch = attempt
            replayed.add(stage.block)
            break
    return schedule_cpu(sch.mod["main"], [name for name in names if name not in replayed], one_thread)
