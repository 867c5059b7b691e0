"""A small, bounded choice among default schedule variants of the conv and GEMM stages, measured on this
machine at compile time and kept in the persistent tuning database (tuning.py), so that a second compile
measures nothing.

Why: the default rules (default.py) are keyed on loop structure and shapes, and a rule that misfires
on a shape nobody wrote it for is never caught: a 128-channel 3x3 conv took the weight-streaming path meant
for ResNeXt's 1x1 convs (streaming.py) at half the speed of its neighbour. As Inductor's and oneDNN's
autotuning do, each distinct GEMM/conv stage of at least MEASURE_MIN_FLOPS (stages.py cuts them out under
canonical names, so equal layers are one workload) is built in at most len(schedule_variants()) default variants
that actually differ (weights streamed or not, the widest conv vector two registers or one, 28 or 14
registers of partial sums), each measured
by MetaSchedule's builder and runner (the least of ROUNDS rounds), and the measurements committed as tuning records in a
database of its own beside the tuned one (`variants_dir`); the scheduler (staged.py) replays a stage's
tuned record where it has one, else its fastest variant. A stage whose workload is in either database is
not measured again.

A rival replaces the default only when it is DEFAULT_MARGIN faster (closer times are noise here); where
the default wins, only the workload is recorded, so the default rules schedule the stage in its kernel,
its epilogue fused (a replayed trace has no epilogue to fuse). Timed alone a stage's weights stay warm,
which hides what streaming saves in a real inference (cold weights): a variant without streaming must
also be STREAM_MARGIN faster than a streaming default (its recorded time is scaled by both margins).

A rival that wins by less than the spread of its or the default's rounds is not recorded yet: the next
compile measures the stage again (at most MAX_RETRIES times, counted beside the records), so a choice made
under load is not replayed forever. The records are keyed by the code's hash (records.database_path): a
changed rule measures again.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Sequence

import tvm_ffi

from souffle_py.codegen.kernels import Kernel
from souffle_py.failures import not_applied
from souffle_py.schedule import tuning
from souffle_py.schedule.records import database_path, locked, replace_atomically
from souffle_py.schedule.blocks import vector_lanes
from souffle_py.schedule.conv import VARIANT, Variant, conv_accumulator_lanes, conv_max_lanes
from souffle_py.schedule.default import schedule_blocks
from souffle_py.schedule.stages import STAGE, compute_stages
from souffle_py.schedule.streaming import streams_weights

log = logging.getLogger(__name__)

MEASURE_MIN_FLOPS = 100e6 # smaller stages are not measured (tiny test models compile without a measurement)
STREAM_MARGIN = 1.15      # a variant without streaming must be this much faster, timed warm and alone
DEFAULT_MARGIN = 1.05     # any variant must be this much faster than the default to replace it: closer
                          # times are noise on a shared machine (ResNeXt-101 took 0.7% "wins" and ran 4% slower)
VARIANTS_FOLDER = "variants"
ROUNDS = 3                # each variant's time: the least of this many rounds, the variants of a round run
                          # one after another (one round on a shared machine: ResNet-50's variants
                          # chosen under load made it 1.28x slower than another compile's)
MAX_STAGES = 8            # stages measured per compile at most (compile time: the corpus under 60 s each)
MAX_RETRIES = 2           # compiles that measure again a stage whose rival won within the rounds' spread
RETRIES_FILE = "close_choices.json"


def choose_variants(kernels: Sequence[Kernel], target, database_dir: str | os.PathLike, quiet: bool = True,
                    min_flops: float | None = None, provisional=None) -> int:
    """Measure the differing default variants of the distinct GEMM/conv stages of `kernels` without a record
    in the database (at most MAX_STAGES, the most work first: calls x FLOPs), all in one build and run, and
    record them; returns how many stages were measured. A close choice (`_within_spread`) is recorded only in
    `provisional` (an in-memory database: this compile uses it, the next one measures the stage again)."""
    from tvm.s_tir.analysis import estimate_tir_flops

    min_flops = MEASURE_MIN_FLOPS if min_flops is None else min_flops
    tasks = {f"{kernel.name}.{stage.block}": stage.func for kernel in kernels for stage in compute_stages(kernel.func)}
    tuned = tuning.open_database(database_dir, target, create=False)
    database = tuning.open_database(variants_dir(database_dir), target)
    start = time.perf_counter()
    candidates = []
    for names in tuning._distinct(tasks):
        func = tasks[names[0]]
        mod = tuning.workload(func)
        flops = estimate_tir_flops(mod)
        if flops >= min_flops and not database.has_workload(mod) and not (tuned and tuned.has_workload(mod)):
            candidates.append((flops * len(names), names[0], func))
    chosen = []
    for _, name, func in sorted(candidates, key=lambda c: -c[0])[:MAX_STAGES]:
        schedules = _distinct_variants(name, func)
        if len(schedules) > 1:  # else nothing to choose: no record, the default rules schedule it as before
            chosen.append((name, func, schedules))
    if not chosen:
        return 0
    flat = [(func, sch) for _, func, schedules in chosen for _, sch in schedules]
    rounds = tuning._measure([sch for _, sch in flat], [func for func, _ in flat], target, rounds=ROUNDS)
    per_round = iter([None if None in times else [t[0] for t in times] for times in zip(*rounds)])
    folder = database_path(variants_dir(database_dir), target)
    retries = _Retries(folder)
    with locked(folder):  # read again under the lock: another process may have appended since (records.py)
        database = tuning.read_database(folder)
        _record_all(chosen, per_round, retries, database, provisional, target)
    tuning._say(quiet, f"variants: {len(chosen)} stages measured in {time.perf_counter() - start:.1f}s")
    return len(chosen)


def _record_all(chosen, per_round, retries, database, provisional, target) -> None:
    """Record each measured stage's choice (a close one only in `provisional`)."""
    for name, func, schedules in chosen:
        times = [next(per_round) for _ in schedules]
        measured = [None if t is None else [min(t)] for t in times]
        close = _within_spread(schedules, times) and retries.again(func)
        if close:
            log.info("variants of %s: the fastest rival's margin is within the rounds' spread; measured again at "
                     "the next compile (%d of %d)", name, retries.count(func), MAX_RETRIES)
        if not close or provisional is not None:
            _record(provisional if close else database, func, schedules, measured, target)
        log.info("variants of %s: %s", name, ", ".join(
            f"{v}: {'failed' if s is None else f'{s[0] * 1e3:.3f} ms'}" for (v, _), s in zip(schedules, measured)))


class _Retries:
    """How many compiles found each stage's choice within the noise (a JSON file beside the variants'
    records, keyed by the workload's structural hash): a close choice is measured again, at most
    MAX_RETRIES times, then recorded as it stands."""

    def __init__(self, folder: Path):
        self.path = Path(folder) / RETRIES_FILE
        try:
            self.counts = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.counts = {}

    def count(self, func) -> int:
        return self.counts.get(_key(func), 0)

    def again(self, func) -> bool:
        """Whether the stage may be measured again; counts this retry."""
        key = _key(func)
        if self.counts.get(key, 0) >= MAX_RETRIES:
            return False
        self.counts[key] = self.counts.get(key, 0) + 1
        self.path.parent.mkdir(parents=True, exist_ok=True)
        replace_atomically(self.path, json.dumps(self.counts).encode())
        return True


def _key(func) -> str:
    return str(tvm_ffi.structural_hash(tuning.workload(func)))


def _within_spread(schedules, times) -> bool:
    """Whether a rival (to the default) wins by less than the rounds' spread of the two: the choice would
    change the schedule on a difference the measurement cannot tell from noise."""
    scaled = _scaled(schedules, [None if t is None else [min(t)] for t in times])
    timed = [(seconds, i) for i, seconds in enumerate(scaled) if seconds is not None]
    if not timed or scaled[0] is None or min(timed)[1] == 0:
        return False
    best = min(timed)[1]
    spread = max(max(times[i]) / min(times[i]) - 1.0 for i in (0, best))
    return scaled[0] / scaled[best] - 1.0 < spread


def provisional_database():
    """Where a compile keeps its close choices: in memory, for its own kernels only."""
    from tvm.s_tir import meta_schedule as ms

    return ms.database.MemoryDatabase()


def variants_dir(database_dir: str | os.PathLike) -> Path:
    """Where the measured variants are recorded: a database beside the tuned records, which it does not
    mix with (a stage measured here is still a task for `souffle tune`), consulted after them."""
    return Path(database_dir) / VARIANTS_FOLDER


def schedule_variants() -> tuple[Variant, ...]:
    """The variants measured, the default first: no streaming, one-vector conv tiles, fewer conv partial
    sums (conv.conv_accumulator_lanes), in the current target's lanes and registers."""
    return (Variant(), Variant(stream=False), Variant(conv_max_lanes=min(vector_lanes(), conv_max_lanes())),
            Variant(conv_accumulator_lanes=conv_accumulator_lanes()))


def _distinct_variants(name: str, func) -> list:
    """[(variant, schedule)] of the schedule_variants() whose schedules of `func` differ, the default first."""
    schedules, seen = [], set()
    for variant in schedule_variants():
        try:
            sch = tuning._scheduled(func, lambda s, v=variant: _apply(s, v))
        except Exception as exc:  # noqa: BLE001  (a variant that does not schedule: the others still compete)
            not_applied(f"schedule variant {variant}", name, exc, "the other variants")
            continue
        text = sch.mod.script()
        if text not in seen:
            seen.add(text)
            schedules.append((variant, sch))
    return schedules


def _apply(sch, variant: Variant) -> None:
    token = VARIANT.set(variant)
    try:
        schedule_blocks(sch, [STAGE])
    finally:
        VARIANT.reset(token)


def _record(database, func, schedules, secs, target) -> None:
    """Commit each measured variant where one beats the default: a streaming schedule's rivals recorded
    STREAM_MARGIN slower than measured, any rival of the default DEFAULT_MARGIN slower (module docstring).
    Where the default wins, only the workload is committed: no record, so the stage is measured no more and
    keeps the default rules, which in its kernel also fuse its epilogue (a replayed trace cannot)."""
    scaled = _scaled(schedules, secs)
    timed = [(seconds, i) for i, seconds in enumerate(scaled) if seconds is not None]
    if not timed or min(timed)[1] == 0:
        database.commit_workload(tuning.workload(func))
        return
    for (_, sch), seconds in zip(schedules, scaled):
        if seconds is not None:
            tuning._commit(database, func, sch, [seconds], target)


def _scaled(schedules, secs) -> list:
    """Each variant's time with its handicaps (STREAM_MARGIN, DEFAULT_MARGIN: the module docstring)."""
    streaming = any(streams_weights(sch.mod["main"]) for _, sch in schedules)
    scaled = []
    for i, ((_, sch), measured) in enumerate(zip(schedules, secs)):
        handicap = (STREAM_MARGIN if streaming and not streams_weights(sch.mod["main"]) else 1.0) * \
            (DEFAULT_MARGIN if i else 1.0)
        scaled.append(None if measured is None else measured[0] * handicap)
    return scaled
