"""optimize(): the compiler driver. It reads top to bottom as the pipeline: load, lower, transform,
analyse, partition, merge, schedule, build."""

from __future__ import annotations

import logging
import os
import time
from typing import Mapping, Sequence

import tvm

from souffle_py.codegen.build import build_kernels
from souffle_py.codegen.kernels import unfused_kernels
from souffle_py.codegen.merge import merged_kernel
from souffle_py.frontend import load_model, lower
from souffle_py.partition import partition, policy_for
from souffle_py.runtime import CompiledModel
from souffle_py.schedule.default import TILE_J, schedule_cpu
from souffle_py.target import compilable_target, device_of
from te_passes.analysis import analyze
from te_passes.layout import pack_weights
from te_passes.pipeline import PassPipeline

log = logging.getLogger("souffle_py")


def optimize(model, target: "str | tvm.target.Target" = "llvm",
             input_shapes: Mapping[str, Sequence[int]] | None = None, passes="all",
             merge: bool = True, trials: int = 0, database: "str | os.PathLike | None" = None,
             quiet: bool = False, fast_math: bool = True) -> CompiledModel:
    """Compile an ONNX model (path or ModelProto) for `target` and return a runnable CompiledModel.

    input_shapes: concrete shapes for inputs with symbolic dimensions, e.g. {"x": (1, 128, 768)}.
    passes: the TE transformations ("all" = "V2": vertical + horizontal; "V1": horizontal only;
        "none" = "V0"; or "vertical,horizontal", a list, a PassPipeline) — the paper's ablation switches.
    merge: partition the program and merge each subprogram into one kernel; False gives every TE its own
        kernel (the unfused reference).
    trials: MetaSchedule trials (in total) for the compute-intensive single-stage kernels that the tuning
        database (`database`, default $SOUFFLE_CACHE/tuning or .souffle_cache/tuning) has no record of yet;
        kernels with a record use it, the others (and every merged multi-stage kernel) get the rule-based
        default schedules. CPU targets only; today this means tuning pays off with merge=False.
    fast_math: float32 exp/erf/tanh/sigmoid as topi's vectorizable approximations (relative error < 4e-7;
        libm's scalar calls are up to 100x slower); False keeps the exact calls.
    """
    start = time.perf_counter()
    tvm_target = compilable_target(target)
    program = lower(load_model(model, input_shapes))
    log.info("lowered %s in %.1fs", program.summary(), time.perf_counter() - start)
    program, records = PassPipeline.from_spec(passes).run(program)
    for record in records:
        log.info("%s", record.line())
    program = pack_weights(program, TILE_J)  # the default GEMM's weight layout (te_passes/layout.py)
    if merge:
        analysis = analyze(program)
        parts = partition(analysis, program.stages, policy_for(tvm_target.kind.name))
        log.info("partitioned %d TEs into %d subprograms", len(program.stages), len(parts.subprograms))
        consumers = program.consumers()
        kernels = [merged_kernel(program, sub.ops, consumers, f"sub{i}", reason=sub.reason, fast_math=fast_math)
                   for i, sub in enumerate(parts.subprograms)]
    else:
        kernels = unfused_kernels(program, fast_math)
    return build_model(program, kernels, tvm_target, start,
                       _schedule_for(kernels, tvm_target, trials, database, quiet))


def _schedule_for(kernels, tvm_target, trials: int, database, quiet: bool):
    """The scheduling function: tune what is asked for, then tuned schedules where recorded, else defaults."""
    from souffle_py.schedule import tuning  # MetaSchedule is only imported when a database is consulted

    database = database or tuning.default_database_dir()
    if trials > 0:
        compute = [k for k in kernels if tuning.is_compute_intensive(k.func)]
        tunable = {k.name: k.func for k in compute if tuning.is_single_stage(k.func)}
        if len(tunable) < len(compute) and not quiet:
            print(f"tuning: {len(compute) - len(tunable)} merged (multi-stage) kernel calls keep the default "
                  "schedules: MetaSchedule's schedules for multi-stage kernels are not trusted (they raced)")
        tuning.tune(tunable, tvm_target, database, trials, quiet=quiet)
    return tuning.tuned_or_default(database, tvm_target)


def build_model(program, kernels, tvm_target, start: float, schedule=schedule_cpu) -> CompiledModel:
    """Schedule, compile and wrap kernels; `start` is when the compilation began (for compile_seconds)."""
    built = build_kernels(kernels, tvm_target, schedule)
    log.info("built %d kernel calls (%d distinct) in %.1fs", len(kernels), built.distinct, built.seconds)
    return CompiledModel(program, kernels, built, device_of(tvm_target), tvm_target,
                         compile_seconds=time.perf_counter() - start)
