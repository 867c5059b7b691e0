"""optimize(): the compiler driver. It reads top to bottom as the pipeline: load, lower, transform, lay out,
partition and merge, schedule, build; the target's backend (souffle_py/backends) answers where targets
differ."""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Mapping, Sequence

from souffle_py import compile_cache
from souffle_py.dynamic import DynamicModel, build_dynamic
from souffle_py.onnx_file import read_onnx
from souffle_py.errors import InputError
from souffle_py.runtime import CompiledModel

if TYPE_CHECKING:
    from souffle_py.backends import Backend

log = logging.getLogger("souffle_py")


def optimize(model, target: "str | tvm.target.Target" = "llvm",
             input_shapes: Mapping[str, Sequence[int]] | None = None, passes="all",
             merge: bool = True, trials: int = 0, database: "str | os.PathLike | None" = None,
             quiet: bool = False, fast_math: bool = True, grid_sync: bool = True,
             precision: str = "fp32", runner: "RpcTracker | None" = None,
             cache: bool | None = None, dynamic: Mapping | None = None,
             precompile=None, fallback: str | None = None, int8: str = "exact") -> "CompiledModel | DynamicModel":
    """Compile an ONNX model (path or ModelProto) for `target` and return a runnable CompiledModel.

    target: "llvm" (the host CPU, default), "cuda" (the present NVIDIA GPU; without one, an H100-class
        sm_90: compiling needs nvcc, not a GPU), "h100", "h200", "a100", or a tvm Target.
    input_shapes: concrete shapes for inputs with symbolic dimensions, e.g. {"x": (1, 128, 768)}.
    passes: which of the target's registered passes run (souffle_py/passes; `souffle passes` lists them):
        "all" = "V2" (default); the paper's ablation "V1" (no vertical transformations) and "V0" = "none"
        (neither: the target's layouts, precision and restructuring alone); pass or group names added to
        V0 ("vertical,horizontal"), or after a preset; "-name" switches one off ("-pack_weights"). A list
        of such names works too.
    merge: partition the program and merge each part into one kernel (CPU: cache-resident subprograms;
        CUDA: large contractions keep tiled kernels, the TEs between them become grid-synchronized
        cooperative kernels); False gives every TE its own kernel (the unfused reference).
    grid_sync: CUDA only; False launches the stages of each grid-synchronized kernel as kernels of their
        own (the ablation of what grid synchronization saves).
    trials: MetaSchedule trials (in total) for the compute-intensive kernels that the tuning database
        (`database`, default $SOUFFLE_CACHE/tuning or .souffle_cache/tuning) has no record of yet; kernels
        with a record use it, the others get the rule-based default schedules. On the CPU each GEMM/conv
        stage is tuned alone against its measured default and replayed inside its merged kernel
        (schedule/staged.py); on CUDA tuning needs a GPU to measure on (here, or through `runner`).
    precision: "fp32" (exact, default), "bf16" or "fp16": the operands of GEMMs (CPU: those with constant
        weights, and convolutions whose input channels pair up, te_passes/precision_conv.py; CUDA: also
        attention's batch matmuls) in bfloat16 / float16, accumulated in float32 (CUDA:
        on tensor cores); everything else float32 (te_passes/precision.py). A target that cannot serve it
        natively (bf16 on a CPU without AVX512_BF16, fp16 on any CPU; bf16 below sm_80, fp16 below sm_70)
        raises TargetError.
    runner: where tuning measures its candidates: None, this machine; an RpcTracker("HOST", PORT, "KEY")
        (or RpcTracker.parse("HOST:PORT", "KEY")), the servers registered with that TVM RPC tracker under
        KEY, in parallel (schedule/runners.py). Candidates are built here either way, and the records go
        into the same database.
    fast_math: CPU: float32 exp/erf/tanh/sigmoid as topi's vectorizable approximations (relative error
        < 4e-7); CUDA: nvcc --use_fast_math. False keeps the exact functions.
    cache: the compile cache (compile_cache.py): a model compiled before with the same bytes, shapes,
        options, target and souffle-py code is loaded from its stored export instead of compiled (then
        `model.cached` is True; such a model has no in-process kernels, so profile(stages=True) needs
        cache=False). None: on unless SOUFFLE_COMPILE_CACHE=0; tuning (trials > 0) always compiles.
    dynamic: dimensions that vary at run time, per input axis -> (min, max), e.g.
        {"input_ids": {0: (1, 8), 1: (1, 512)}}, or per symbolic dimension name of the ONNX graph,
        {"batch": (1, 8), "sequence": (1, 512)} (dynamic_spec.py). Returns a DynamicModel (dynamic.py) that
        runs any shape in range: each shape is compiled exactly for itself on first use (through the compile
        cache), so a call runs at the speed of a static compile of its shape. Not with input_shapes or trials.
    precompile: with dynamic, the shapes compiled before optimize() returns: "min" (default: the smallest,
        so a model the compiler cannot handle fails here), "max", "none", a shape {"sequence": 128, ...} or
        a list of them.
    fallback: with dynamic, None (default: a call at a new shape waits for its compile) or "onnxruntime" (it
        runs at once in an ONNX Runtime session while the shape compiles in the background).
    int8: the integer GEMMs' and convolutions' arithmetic on x86 CPUs without VNNI: "exact" (default: two
        vpmaddwd per 32 products) or "saturating" (vpmaddubsw, as ONNX Runtime's and OpenVINO's AVX2
        kernels: a pair of u8 x s8 products summed past +-32767 saturates; about 1.3x faster loops on Zen
        3, and errors against float32 up to those runtimes'), in the GEMMs and convs whose activations
        have a low zero point (ReLU-like) or one set at run time; zero-centred ones stay exact
        (schedule/int8_dot.py, docs/precision.md). With VNNI (vpdpbusd) both are exact.
    """
    if dynamic is not None:
        return _optimize_dynamic(model, dynamic, precompile, input_shapes, trials, fallback,
                                 dict(target=target, passes=passes, merge=merge, database=database, quiet=quiet,
                                      fast_math=fast_math, grid_sync=grid_sync, precision=precision, cache=cache,
                                      int8=int8))
    if precompile is not None or fallback is not None:
        raise InputError("precompile and fallback concern a model with dynamic dimensions: give dynamic= too")
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 0:
        raise InputError(f"trials must be a non-negative integer, got {trials!r}")
    start = time.perf_counter()
    alias = None
    if compile_cache.enabled(cache) and trials == 0:  # a compile seen before: answered before TVM is imported
        alias = compile_cache.alias_key(model, _call(target, input_shapes, passes, merge, database, fast_math,
                                                     grid_sync, precision, int8))
        entry = compile_cache.resolve(alias)
        hit = compile_cache.load_entry(entry, start) if entry else None
        if hit is not None:
            return hit
    # the compiler, imported here: a process that only loads compiled models never imports TVM's compiler
    from souffle_py.assemble import build_model
    from souffle_py.backends import backend_for
    from souffle_py.frontend import load_model, lower
    from souffle_py.passes import PassContext, passes_for, run_passes, select
    from souffle_py.schedule.runners import RpcTracker
    from souffle_py.schedule.int8_dot import ARITHMETICS, int8_notes, int8_option
    from te_passes.precision import PRECISIONS

    if runner is not None and not isinstance(runner, RpcTracker):
        raise InputError(f"runner must be None (measure here) or an RpcTracker, got {type(runner).__name__}")
    if precision not in PRECISIONS:
        raise InputError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if int8 not in ARITHMETICS:
        raise InputError(f"int8 must be one of {', '.join(ARITHMETICS)}, got {int8!r}")
    backend = backend_for(target)
    backend.check_precision(precision)
    steps = passes_for(backend.device)
    enabled = select(passes, steps)  # a bad name fails before anything is loaded
    entry = None
    if compile_cache.enabled(cache) and trials == 0:
        entry = _cache_key(model, backend, dict(input_shapes=input_shapes, passes=sorted(enabled), merge=merge,
                                                database=database, fast_math=fast_math, grid_sync=grid_sync,
                                                precision=precision, **_int8_key(int8)))
        hit = compile_cache.load_entry(entry, start)
        if hit is not None:
            compile_cache.remember(alias, entry)
            return hit
    context = PassContext(backend, precision, merge)
    with int8_option(int8):  # which int8 stages may saturate (schedule/int8_dot.py)
        proto, _ = run_passes(load_model(model, input_shapes), steps, context, enabled, level="onnx")
        program = lower(proto)
        log.info("lowered %s in %.1fs", program.summary(), time.perf_counter() - start)
        program, _ = run_passes(program, steps, context, enabled)
        kernels = (backend.fused_kernels(program, fast_math, grid_sync) if merge
                   else backend.unfused_kernels(program, fast_math))
        schedule = backend.scheduler(kernels, trials, database, quiet, runner=runner)
        notes = int8_notes(program.stages)  # the stages' own marks: none off the CPU
        compiled = build_model(program, kernels, backend, schedule, start, fast_math, precision, notes)
    if entry is not None:
        compile_cache.store(compiled, entry, {"model": str(model) if isinstance(model, (str, os.PathLike)) else
                                              "a ModelProto", "target": compiled.target_description,
                                              "compile_seconds": compiled.compile_seconds})
        compile_cache.remember(alias, entry)
    return compiled


def _optimize_dynamic(model, dynamic, precompile, input_shapes, trials, fallback, options: dict) -> DynamicModel:
    """optimize(dynamic=...): a DynamicModel whose shapes this function compiles (dynamic.py)."""
    if input_shapes is not None:
        raise InputError("give either input_shapes (one concrete shape) or dynamic (ranges), not both: fix a "
                         "dimension with the range (n, n)")
    if trials:
        raise InputError("trials with dynamic: tune the shapes you serve with input_shapes first (the tuning "
                         "database serves every compile that meets the same kernels)")
    if precompile == "none" or (isinstance(precompile, (list, tuple)) and all(p == "none" for p in precompile)):
        from souffle_py.backends import backend_for  # else the first compile checks them (or a cached one did)
        from souffle_py.passes import passes_for, select

        select(options["passes"], passes_for(backend_for(options["target"]).device))  # a bad target or pass
    target = options.pop("target")
    return build_dynamic(read_onnx(model), dynamic, precompile, _specialise, target, options, fallback)


def _specialise(model, **options) -> CompiledModel:
    return optimize(model, **options)


def _int8_key(int8: str) -> dict:
    """The int8 option as a cache key's part: absent at the default, so keys made before it existed still hit."""
    return {} if int8 == "exact" else {"int8": int8}


def _call(target, input_shapes, passes, merge, database, fast_math, grid_sync, precision, int8) -> dict:
    """optimize()'s arguments as given, as JSON (the compile cache's alias)."""
    if not isinstance(target, (str, dict)):
        target = f"{type(target).__name__}:{target}"
    shapes = {str(k): list(v) if isinstance(v, (list, tuple)) else str(v) for k, v in (input_shapes or {}).items()} \
        if isinstance(input_shapes, dict) else str(input_shapes)
    return dict(target=target, input_shapes=shapes, passes=passes if isinstance(passes, (str, type(None))) else
                [str(p) for p in passes], merge=merge, database=str(database) if database else None,
                fast_math=fast_math, grid_sync=grid_sync, precision=precision,
                **_int8_key(int8))


def _cache_key(model, backend: Backend, options: dict) -> str:
    """The compile cache's key: the model, the options, the target and, where tuning records exist for it,
    their state (tuning more makes a new key)."""
    from souffle_py.schedule.records import default_database_dir, records_fingerprint

    options = {**options, "input_shapes": {k: list(v) for k, v in (options["input_shapes"] or {}).items()}}
    records = records_fingerprint(options["database"] or default_database_dir(), backend.target)
    return compile_cache.key(model, options, f"{backend.target}|{records}")


