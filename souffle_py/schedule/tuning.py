"""MetaSchedule tuning with a persistent database: each distinct PrimFunc is tuned once per target.

A workload is the PrimFunc itself, found again by MetaSchedule's JSONDatabase through its structural hash,
so a second compile of the same model (or of another model with the same GEMMs) only looks records up.
MetaSchedule's record query ignores the target, so every target gets its own database folder.

With a `baseline` (the CPU's stage tasks, staged.py) the default schedule competes: it seeds the search,
and the records that schedule kernels are the default and the best candidates measured again back to back.

Two things differ from MetaSchedule's defaults, both for this project's machines (see DESIGN.md):
the builder compiles with `tvm.compile` directly, through souffle-py's TIR pipeline (the default build
imports `tvm.s_tir.tensor_intrin` in every worker, which outlives its 30 s timeout on 2 cores), and
progress is one line per task per round,
while MetaSchedule's own (IR-dumping) log goes to tuning.log in the database folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Mapping, NamedTuple

import numpy as np
import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.analysis import estimate_tir_flops

from souffle_py.errors import NoRpcServersError
from souffle_py.host import num_threads
from souffle_py.schedule.blocks import block_kind
from souffle_py.schedule.records import database_path, default_database_dir  # noqa: F401  (the tuning API's)
from souffle_py.schedule.races import parallel_write_races
from souffle_py.schedule.records import locked, repair, set_aside
from souffle_py.schedule.runners import RpcTracker, check_servers_left, metaschedule_runner
from souffle_py.schedule.streaming import streams_weights
from souffle_py.structural import StructuralMap, deep_copy

TRIALS_PER_ROUND = 32   # candidates measured per task per round: small rounds let the cost model steer
MIN_TRIALS_PER_ROUND = 8
BUILD_TIMEOUT_S = 120.0
CUDA_BUILD_TIMEOUT_S = 300.0  # nvcc per candidate: MetaSchedule's default 30 s killed every one on an H100 machine
RECORDS_CHECKED = 8     # best records examined for races before falling back to the default schedule
SELECT_TOP = 3          # searched schedules measured again against the default, back to back
SELECT_ROUNDS = 3       # ... this many times each, interleaved; the median counts

log = logging.getLogger(__name__)
_normalize_mod = tvm_ffi.get_global_func("tvm.s_tir.meta_schedule.normalize_mod")


def is_compute_intensive(func: tirx.PrimFunc) -> bool:
    """Whether a stage of `func` accumulates products of two tensors (GEMM, batch matmul, conv): where tuning
    pays off."""
    sch = s_tir.Schedule(func)
    return any(block_kind(sch, block) in ("gemm", "conv") for block in sch.get_child_blocks(sch.get_sblock("root")))


def open_database(database_dir: str | os.PathLike, target, create: bool = True) -> ms.Database | None:
    """The JSON database of `target` under `database_dir`; None if it does not exist and create is False."""
    path = database_path(database_dir, target)
    if not create and not (path / "database_tuning_record.json").exists():
        return None
    return _json_database(path)


def _json_database(path: Path) -> ms.Database:
    """MetaSchedule's JSONDatabase in `path`, read under the folder's lock (`read_database`)."""
    with locked(path):
        return read_database(path)


def read_database(path: Path) -> ms.Database:
    """MetaSchedule's JSONDatabase in `path`, its files repaired first if a tune was interrupted; a folder
    TVM refuses (records pointing at the wrong workloads) is set aside with a warning and started empty: its
    stages are measured or tuned again, the compile goes on (records.py). The caller holds `locked(path)`."""
    path.mkdir(parents=True, exist_ok=True)
    repair(path)
    try:
        return ms.database.JSONDatabase(work_dir=str(path))
    except Exception as exc:  # noqa: BLE001  (TVM's errors: the files, not the compile, are at fault)
        aside = set_aside(path)
        reason = str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else type(exc).__name__
        log.warning("the tuning records in %s could not be read (%s); moved to %s, starting anew", path, reason,
                    aside)
        return ms.database.JSONDatabase(work_dir=str(path))


def workload(func: tirx.PrimFunc) -> tvm.IRModule:
    """The IRModule MetaSchedule keys `func` by, whatever its symbol: MetaScheduleApplyDatabase's normalization
    of a Relax PrimFunc (which has no symbol yet), so Relax and souffle-py share records. A deep copy: a
    Schedule made from the only reference to a function mutates its nodes in place, and would otherwise
    rewrite `func` itself (which shares them)."""
    return deep_copy(_normalize_mod(func.with_attr("global_symbol", "main")))


def apply_database(func: tirx.PrimFunc, target, database_dir: str | os.PathLike) -> tirx.PrimFunc | None:
    """The best tuned schedule of `func` from the database, or None (a lookup; nothing is tuned)."""
    database = open_database(database_dir, target, create=False)
    return None if database is None else _query(database, func, target)


def tuned_or_default(database_dir: str | os.PathLike, target, default: Callable[[tirx.PrimFunc], tirx.PrimFunc],
                     accept: Callable[[tirx.PrimFunc], bool] = lambda func: True
                     ) -> Callable[[tirx.PrimFunc], tirx.PrimFunc]:
    """A schedule function for build_kernels: the tuned schedule where the database has one for a kernel
    that `accept`s tuning (on the CPU: single-stage kernels), else `default(func)`."""
    database = open_database(database_dir, target, create=False)

    def schedule(func: tirx.PrimFunc) -> tirx.PrimFunc:
        tuned = None if database is None or not accept(func) else _query(database, func, target)
        return default(func) if tuned is None else tuned

    return schedule


def tune(funcs: Mapping[str, tirx.PrimFunc], target: tvm.target.Target, database_dir: str | os.PathLike,
         trials: int, *, weights: Mapping[str, float] | None = None, trials_per_round: int = TRIALS_PER_ROUND,
         quiet: bool = False, baseline: Callable[[s_tir.Schedule], None] | None = None,
         runner: RpcTracker | None = None) -> dict[str, tirx.PrimFunc]:
    """Tune the functions without a database record and return the tuned schedule of every function that has one.

    Structurally equal functions form one task whose weight is the sum of theirs (default 1 each, so pass
    every kernel call and identical layers weigh by their count). `trials` is the total budget; MetaSchedule's
    gradient task scheduler spends it where the weighted latency falls fastest.
    baseline: schedules a task's workload the way it is compiled without tuning. The search then runs in
    a database of its own (`search/` in the target's folder), seeded with that schedule measured like a
    candidate; afterwards the default and the best few candidates are measured again, back to back and
    interleaved, and only those measurements go into the database proper, so a task's best record is
    min(default, tuned) as measured at one time (single measurements on a shared machine picked slower
    schedules as winners when the default had been measured in a busy phase).
    runner: the RPC tracker whose servers measure the candidates (runners.py); None measures here.
    """
    database = open_database(database_dir, target)
    groups = _distinct(funcs)
    todo = [names for names in groups if _query(database, funcs[names[0]], target) is None]
    # a default that streams weights beyond L2 is left alone: no searched schedule streams, and one that
    # won even with its weights cold made BERT-base slower (FFN 2: 2.47 against 2.72 ms alone, the model
    # 87.9 -> 96.5 ms; QKV, FFN 1 and FFN 2 tuned, chosen warm: 4% slower, in a busy phase)
    streamed = [names for names in todo
                if baseline is not None and streams_weights(_scheduled(funcs[names[0]], baseline).mod["main"])]
    todo = [names for names in todo if names not in streamed]
    _say(quiet, f"tuning: {len(groups)} distinct workloads, {len(groups) - len(todo) - len(streamed)} already "
                f"tuned, {len(streamed)} keeping a default that streams its weights (schedule/streaming.py), "
                f"{len(todo) if trials > 0 else 0} to tune with {trials} trials")
    if todo and trials > 0:
        start = time.perf_counter()
        measurer, servers = metaschedule_runner(runner)  # fails here, before building, without a tracker
        # one builder for the whole tune: its workers import TVM and souffle-py once, not once per measurement
        measuring = _Measuring(_builder(target, num_threads(), remote=runner is not None), measurer, runner)
        if runner is not None:
            _say(quiet, f"tuning: measuring on the {servers} server(s) of the RPC tracker at {runner}")
        defaults = {}
        firsts, first_names = [funcs[names[0]] for names in todo], [names[0] for names in todo]
        search = database
        if baseline is not None:
            search = _json_database(database_path(database_dir, target) / "search")
            defaults = _commit_baselines(firsts, first_names, baseline, target, search, quiet, measuring)
        # about half a task's fair share per round: the gradient scheduler's first pass reaches every task
        # and leaves it rounds to steer
        share = trials // len(todo)
        per_round = max(1, min(trials_per_round, max(share // 2, min(share, MIN_TRIALS_PER_ROUND))))
        _tune_tasks(firsts, first_names, [sum((weights or {}).get(n, 1.0) for n in names) for names in todo],
                    target, search, trials, per_round, quiet, defaults, measuring)
        if baseline is not None:
            for func, name in zip(firsts, first_names):
                _select(func, name, baseline, target, search, database, quiet, measuring)
        _say(quiet, f"tuning: done in {time.perf_counter() - start:.0f}s")
    tuned = {}
    for names in groups:
        func = _query(database, funcs[names[0]], target)
        if func is not None:
            tuned.update(dict.fromkeys(names, func))
    return tuned


def _tune_tasks(funcs, names, weights, target, database, trials, per_round, quiet, defaults, measuring) -> None:
    cores = num_threads()
    folder = Path(database.path_workload).parent
    contexts, kept_weights = [], []
    for func, name, weight in zip(funcs, names, weights):
        context = ms.TuneContext(workload(func), target=target, space_generator=_space_generator(target),
                                 search_strategy="evolutionary", task_name=name, num_threads=cores,
                                 logger=logging.getLogger(f"{__name__}.task.{name}")).clone()
        try:  # MetaSchedule's rules can fail on a large merged kernel; that kernel keeps its default schedule
            context.generate_design_space()
        except Exception as exc:
            _say(quiet, f"tuning: skipping {name}: MetaSchedule cannot build its design space "
                        f"({str(exc).strip().splitlines()[0][:160]}); it keeps the default schedule")
            continue
        contexts.append(context)
        kept_weights.append(weight)
    if not contexts:
        return
    weights = kept_weights
    stop = _StopWithoutServers(measuring.tracker)
    callbacks = [*ms.MeasureCallback.create("default"), stop]
    if not quiet:
        callbacks = [*callbacks, _Progress(defaults)]
    with _metaschedule_log(folder / "tuning.log"), stop.raising():
        ms.tune_tasks(
            tasks=contexts, task_weights=weights, work_dir=str(folder),
            max_trials_global=trials, num_trials_per_iter=per_round,
            builder=measuring.builder, runner=measuring.runner, database=database,
            cost_model=ms.CostModel.create("xgb", num_tuning_cores=cores), measure_callbacks=callbacks,
            task_scheduler="gradient")


def _space_generator(target):
    """MetaSchedule's rules and postprocessors for `target`; on the CPU the last postprocessor rejects
    candidates with parallel write races, so that no racy schedule is measured or recorded."""
    if target.kind.name != "llvm":
        return "post-order-apply"
    return ms.space_generator.PostOrderApply(sch_rules="llvm", postprocs=[*ms.Postproc.create("llvm"), RejectRaces()],
                                             mutator_probs="llvm")


@derived_object
class RejectRaces(ms.postproc.PyPostproc):
    """A postprocessor that fails a candidate whose parallel loops write shared elements from every
    iteration (races.py): MetaSchedule then drops it before building it."""

    def _initialize_with_tune_context(self, context) -> None:
        pass

    def apply(self, sch: s_tir.Schedule) -> bool:
        return not any(parallel_write_races(func) for func in sch.mod.functions.values()
                       if isinstance(func, tirx.PrimFunc))

    def clone(self) -> "RejectRaces":
        return RejectRaces()


def _commit_baselines(funcs, names, baseline, target, database, quiet, measuring) -> dict[str, float]:
    """Measure each function as `baseline` schedules it, with the tuning builder and runner, and commit
    the schedule's trace as a tuning record: the candidate to beat. Returns the seconds by task name."""
    schedules = [_scheduled(func, baseline) for func in funcs]
    measured = {}
    for func, name, sch, secs in zip(funcs, names, schedules, _measure(schedules, funcs, target, measuring)[0]):
        if secs is None:
            _say(quiet, f"tuning: {name}: the default schedule failed to build or run; tuning without it")
            continue
        _commit(database, func, sch, secs, target)
        measured[name] = secs[0]
        _say(quiet, f"tuning: {name}: default schedule {secs[0] * 1e3:.3f} ms "
                    f"({estimate_tir_flops(workload(func)) / secs[0] / 1e9:.1f} GFLOP/s)")
    return measured


def _select(func, name, baseline, target, search, database, quiet, measuring) -> None:
    """Measure the default and the SELECT_TOP best searched schedules of `func` SELECT_ROUNDS times, back to
    back, and commit their median times to `database`: the records that schedule the compiled kernels."""
    schedules = [_scheduled(func, baseline)]
    mod = workload(func)
    if search.has_workload(mod):
        for record in search.get_top_k(search.commit_workload(mod), SELECT_TOP + 2):
            if len(schedules) <= SELECT_TOP and _is_sampled(record.trace):
                schedules.append(_scheduled(func, lambda sch: record.trace.apply_to_schedule(sch, False)))
    rounds = _measure(schedules, [func] * len(schedules), target, measuring, SELECT_ROUNDS)
    medians = [None if any(r[i] is None for r in rounds) else float(np.median([r[i][0] for r in rounds]))
               for i in range(len(schedules))]
    for sch, median in zip(schedules, medians):
        if median is not None:
            _commit(database, func, sch, [median], target)
    tuned = [m for m in medians[1:] if m is not None]
    default, best = medians[0], min(tuned, default=None)
    if default is None and best is None:
        _say(quiet, f"tuning: {name}: neither the default nor a tuned schedule ran; it keeps the default")
        return
    winner = "tuned" if default is None or (best is not None and best < default) else "default"
    _say(quiet, f"tuning: {name}: measured again back to back: default "
                f"{'failed' if default is None else f'{default * 1e3:.3f} ms'}, best tuned "
                f"{'none' if best is None else f'{best * 1e3:.3f} ms'}: the {winner} schedule is used")


def _scheduled(func, apply) -> s_tir.Schedule:
    sch = s_tir.Schedule(workload(func))
    apply(sch)
    return sch


def _is_sampled(trace) -> bool:
    """Whether a trace came from the search (it samples tiles, unrolls...), not from a default schedule."""
    return any(inst.kind.name.startswith("Sample") for inst in trace.insts)


class _Measuring(NamedTuple):
    """The builder and runner of one tune (and the RPC tracker behind the runner, if any)."""

    builder: ms.Builder
    runner: ms.Runner
    tracker: RpcTracker | None


def _measure(schedules, funcs, target, measuring: _Measuring | None = None, rounds: int = 1) -> list[list]:
    """Per round, [mean seconds] per schedule (None where it failed to build or run): built once by the
    tuning builder, then run `rounds` times in order by its runner (None: a builder and runner here). The
    builds' directories are removed afterwards, as MetaSchedule's own loop does (each compile that measured
    variants left some 30 of them in the temporary folder)."""
    if measuring is None:
        measuring = _Measuring(_builder(target, num_threads()), metaschedule_runner(None)[0], None)
    built = measuring.builder.build([ms.builder.BuilderInput(sch.mod, target) for sch in schedules])
    try:
        return _run_rounds(built, funcs, target, measuring, rounds)
    finally:
        for b in built:
            if b.error_msg is None and b.artifact_path:
                shutil.rmtree(os.path.dirname(str(b.artifact_path)), ignore_errors=True)


def _run_rounds(built, funcs, target, measuring: _Measuring, rounds: int) -> list[list]:
    device = "cpu" if target.kind.name == "llvm" else target.kind.name
    args = [ms.arg_info.ArgInfo.from_prim_func(func) for func in funcs]
    ran = [ms.runner.RunnerInput(b.artifact_path, device, a) for b, a in zip(built, args) if b.error_msg is None]
    measured = []
    for _ in range(rounds):
        results = [future.result() for future in measuring.runner.run(ran)]
        check_servers_left(measuring.tracker, results)
        results = iter(results)
        secs = []
        for b in built:
            result = None if b.error_msg is not None else next(results)
            ok = result is not None and result.error_msg is None
            secs.append([sum(float(x) for x in result.run_secs) / len(result.run_secs)] if ok else None)
        measured.append(secs)
    return measured


def _commit(database, func, sch, secs, target) -> None:
    database.commit_tuning_record(ms.database.TuningRecord(
        sch.trace, database.commit_workload(workload(func)), secs, target, ms.arg_info.ArgInfo.from_prim_func(func)))


@contextlib.contextmanager
def _metaschedule_log(path: Path):
    """Send MetaSchedule's loggers and the task loggers to `path` instead of the console while tuning."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    loggers = [logging.getLogger("tvm.s_tir.meta_schedule"), logging.getLogger(f"{__name__}.task")]
    saved = [(logger.level, logger.propagate) for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.INFO)
        logger.propagate = False
        logger.addHandler(handler)
    try:
        yield
    finally:
        for logger, (level, propagate) in zip(loggers, saved):
            logger.removeHandler(handler)
            logger.setLevel(level)
            logger.propagate = propagate
        handler.close()


def _builder(target, cores: int, remote: bool = False):
    """CPU: `tvm.compile` without the tensor_intrin import (_build_function). CUDA: MetaSchedule's default
    build, which compiles with nvcc, with a timeout long enough for nvcc. remote: candidates linked into
    shared libraries here, so that the measuring servers need no compiler or linker."""
    export = {"f_export": _export_shared_library()} if remote else {}
    if target.kind.name == "cuda":
        return ms.builder.LocalBuilder(max_workers=cores, timeout_sec=CUDA_BUILD_TIMEOUT_S, **export)
    return ms.builder.LocalBuilder(max_workers=cores, timeout_sec=BUILD_TIMEOUT_S, f_build=_build_function(), **export)


def _export_shared_library():
    """MetaSchedule's export as a linked .so instead of a .tar of objects (which the server links)."""

    def export(mod) -> str:
        import os
        import tempfile

        # a directory of its own: MetaSchedule's clean-up removes the artifact's whole directory
        # (shutil.rmtree(os.path.dirname(path)), meta_schedule/utils.py); a file straight in /tmp took /tmp
        path = os.path.join(tempfile.mkdtemp(prefix="souffle-candidate-"), "candidate.so")
        mod.export_library(path)
        return path

    return export


def _build_function():
    """MetaSchedule's default build without its `tvm.s_tir.tensor_intrin` import, through souffle-py's TIR
    pipeline (codegen/stack_locals.py) after the schedule's marks are lowered (finish.py), so that
    candidates are measured as the model will run them. A nested function, so that cloudpickle ships it to
    the builder workers by value."""

    def build(mod: tvm.IRModule, target, _params) -> tvm.runtime.Module:
        from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

        from souffle_py.codegen.stack_locals import PIPELINE
        from souffle_py.schedule.finish import finish_schedule

        mod = tvm.IRModule({gv: finish_schedule(f) if isinstance(f, tvm.tirx.PrimFunc) else f
                            for gv, f in mod.functions.items()})
        return tvm.compile(RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod), target=target,
                           tir_pipeline=PIPELINE).mod

    return build


@derived_object
class _StopWithoutServers(ms.measure_callback.PyMeasureCallback):
    """Stop the tune (NoRpcServersError) after a round in which the RPC tracker's key had no server left;
    the round's records are in the database by then (the default callbacks run first)."""

    def __init__(self, runner: RpcTracker | None):
        self.runner = runner
        self.error = None

    def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results) -> None:
        try:
            check_servers_left(self.runner, runner_results)
        except NoRpcServersError as exc:
            self.error = exc
            raise

    @contextlib.contextmanager
    def raising(self):
        """The NoRpcServersError itself, whatever MetaSchedule's C++ task scheduler made of it on the way."""
        try:
            yield
        except Exception:
            if self.error is not None:
                raise self.error from None
            raise


@derived_object
class _Progress(ms.measure_callback.PyMeasureCallback):
    """After each measured round: task, trials so far and the best GFLOP/s found (and whether it beats the
    task's default schedule, when that was measured)."""

    def __init__(self, defaults: Mapping[str, float] | None = None):
        self.trials = Counter()
        self.best = {}
        self.defaults = dict(defaults or {})

    def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results) -> None:
        task = task_scheduler.tasks_[task_id]
        self.trials[task_id] += len(runner_results)
        secs = [sum(float(s) for s in r.run_secs) / len(r.run_secs) for r in runner_results if r.error_msg is None]
        if secs:
            self.best[task_id] = min([*secs, self.best.get(task_id, float("inf"))])
        best = self.best.get(task_id)
        result = "no valid candidate" if best is None else f"best {best * 1e3:.3f} ms"
        if best and task.flop:
            result += f" ({task.flop / best / 1e9:.1f} GFLOP/s)"
        default = self.defaults.get(task.ctx.task_name)
        if best and default:
            result += f", {'beats' if best < default else 'behind'} the default ({default * 1e3:.3f} ms)"
        failed = len(runner_results) - len(secs)
        print(f"tuning: {task.ctx.task_name}: {self.trials[task_id]} trials, {result}"
              + (f", {failed} failed this round" if failed else ""), flush=True)


def _distinct(funcs: Mapping[str, tirx.PrimFunc]) -> list[list[str]]:
    """Names grouped by equal workloads (structurally equal functions), in first-seen order."""
    groups: list[list[str]] = []
    group_of = StructuralMap()
    for name, func in funcs.items():
        key = workload(func)
        group = group_of.get(key)
        if group is None:
            group = []
            groups.append(group)
            group_of.set(key, group)
        group.append(name)
    return groups


def _query(database: ms.Database, func: tirx.PrimFunc, target) -> tirx.PrimFunc | None:
    """The fastest recorded schedule of `func` that is free of parallel write races (MetaSchedule can
    compute a producer redundantly under a parallel loop into a shared buffer: fast, and wrong)."""
    mod = workload(func)
    if not database.has_workload(mod):
        return None
    for record in database.get_top_k(database.commit_workload(mod), RECORDS_CHECKED):
        sch = s_tir.Schedule(record.workload.mod)
        record.trace.apply_to_schedule(sch, remove_postproc=False)
        races = parallel_write_races(sch.mod["main"])
        if not races:
            return sch.mod["main"]
        log.debug("tuned schedule rejected (%s); trying the next record", races[0])
    return None


def best_traces(database: ms.Database, func: tirx.PrimFunc, count: int = RECORDS_CHECKED) -> list:
    """The traces of the `count` fastest records of `func`, fastest first (none without a record)."""
    mod = workload(func)
    if not database.has_workload(mod):
        return []
    return [record.trace for record in database.get_top_k(database.commit_workload(mod), count)]


def _say(quiet: bool, line: str) -> None:
    if not quiet:
        print(line, flush=True)
