"""GPU schedules of one kernel function: grid-synchronized kernels get grid.py's one schedule; the others
(tiled kernels, unfused TEs) dlight's default GPU rules where they apply and a thread-per-output rule
where they do not.

dlight's rules (after TensorCoreMatmul for float16 / bfloat16 GEMMs, tensor_cores.py: Matmul, GEMV,
Reduction, GeneralReduction, Fallback) match whole PrimFuncs: the first one
that binds every block wins. Fallback binds any function without a time loop (one thread per output
element, reductions serial), so it covers convolutions, batch matmuls and reductions over non-innermost
axes that the others refuse. Outside a grid kernel, a recurrence's time loop (codegen/recurrence.py)
stays a serial loop on the host (TVM launches the step kernels once per iteration: a host loop of
kernels); its blocks get `bind_below_time_loops`.
"""

from __future__ import annotations

import logging

import tvm
from tvm import s_tir, tirx
from tvm.s_tir import dlight as dl

from souffle_py.backends.cuda.grid_stages import selector
from souffle_py.backends.cuda.grid import grid_blocks, schedule_marked
from souffle_py.backends.cuda.tensor_cores import TensorCoreMatmul
from souffle_py.backends.cuda.transplant import stage_schedules
from souffle_py.backends.cuda.launches import unbound_blocks
from souffle_py.codegen.recurrence import is_time_loop
from souffle_py.errors import SouffleError
from souffle_py.failures import describe_exception, rule_failed

log = logging.getLogger(__name__)

THREADS = 256   # threads per block of the thread-per-output rule
GRID_TILE = "grid.py's tile for its GEMM stages"   # a grid kernel's fallback when its stage schedules fail
SPATIAL, REDUCE = 0, 2


def dlight_rules():
    """dlight's rules, after the tensor-core GEMM of reduced-precision operands (tensor_cores.py)."""
    return (TensorCoreMatmul(), dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback())


class GpuScheduleError(SouffleError):
    """No GPU schedule binds every block of a kernel to GPU threads."""


def gpu_schedules(func: tirx.PrimFunc, target: tvm.target.Target, database=None, failures: list | None = None):
    """(rule, scheduled func) for each rule that binds every block of `func`, best first: dlight's rules,
    then one thread per output element. A later one replaces a schedule that TVM or nvcc cannot compile
    (dlight's vectorized epilogues sometimes hit CUDA codegen bugs). A grid-synchronized kernel's GEMM
    stages keep their own schedules (their `database` records, else dlight's; transplant.py); should that
    kernel not schedule or compile, its second candidate gives every GEMM stage grid.py's tile (the first
    one's exception appended to `failures`, else named by failures.rule_failed)."""
    if grid_blocks(func) is not None:
        stages = stage_schedules(func, target, selector(func), database)
        attempts = [stages, {}] if stages else [{}]
        for i, stage_candidates in enumerate(attempts):
            try:
                scheduled = schedule_marked(func, stage_candidates)
            except SouffleError:
                raise  # a failure already named (strict mode), or a user-facing error
            except Exception as exc:  # noqa: BLE001  (the caller names it: failures.rule_failed)
                if i + 1 == len(attempts):
                    raise GpuScheduleError(f"grid schedule: {describe_exception(exc)}") from None
                if failures is None:
                    rule_failed("grid schedule", "a grid kernel", exc, fallback=GRID_TILE)
                else:
                    failures.append(exc)
                continue
            yield "grid", scheduled
        return
    tried = []
    if not _has_time_loop(func):
        for rule in dlight_rules():
            name = type(rule).__name__
            try:
                with target:  # (never yield inside it: a generator dropped there leaves the target scope late)
                    sch = rule.apply(func, target, False)
            except Exception as exc:  # a rule that does not fit may raise instead of returning None
                tried.append(f"{name}: {str(exc).strip().splitlines()[0][:100] if str(exc).strip() else type(exc).__name__}")
                continue
            if sch is None:
                continue
            scheduled = (sch[0] if isinstance(sch, list) else sch).mod["main"]
            missing = unbound_blocks(scheduled)
            if missing:
                tried.append(f"{name}: left {missing} unbound")
                continue
            yield name, scheduled
    try:
        scheduled = bind_below_time_loops(func)
    except Exception as exc:
        tried.append(f"thread per output: {str(exc).strip().splitlines()[0][:100]}")
    else:
        missing = unbound_blocks(scheduled)
        if not missing:
            yield "thread per output", scheduled
            return
        tried.append(f"thread per output: left {missing} unbound")
    raise GpuScheduleError("no GPU schedule rule binds every block (" + "; ".join(tried) + ")")


def _has_time_loop(func: tirx.PrimFunc) -> bool:
    sch = s_tir.Schedule(func)
    return any(is_time_loop(sch, loop) for block in sch.get_child_blocks(sch.get_sblock("root"))
               for loop in sch.get_loops(block))


def bind_below_time_loops(func: tirx.PrimFunc, threads: int = THREADS) -> tirx.PrimFunc:
    """One thread per output element of each block, below any time loop (which stays serial on the host):
    the block's spatial loops fused and split over blockIdx.x x threadIdx.x, its reduction loops serial."""
    sch = s_tir.Schedule(func)
    for block in sch.get_child_blocks(sch.get_sblock("root")):
        loops = list(sch.get_loops(block))
        times = [i for i, loop in enumerate(loops) if is_time_loop(sch, loop)]
        inner = loops[times[-1] + 1:] if times else loops
        iter_vars = list(sch.get(block).iter_vars)[-len(inner):] if inner else []
        spatial = [l for l, iv in zip(inner, iter_vars) if int(iv.iter_type) == SPATIAL]
        reduce = [l for l, iv in zip(inner, iter_vars) if int(iv.iter_type) == REDUCE]
        if not spatial:
            spatial = [sch.add_unit_loop(inner[0] if inner else block)]
        sch.reorder(*spatial, *reduce)
        fused = sch.fuse(*spatial) if len(spatial) > 1 else spatial[0]
        extent = int(sch.get(fused).extent)
        outer, lane = sch.split(fused, [None, min(threads, extent)])
        sch.bind(outer, "blockIdx.x")
        sch.bind(lane, "threadIdx.x")
        if reduce:
            sch.decompose_reduction(block, reduce[0])
    return sch.mod["main"]
