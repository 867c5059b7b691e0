"""NVIDIA GPUs (CUDA): the GPU partition (large contractions keep tiled dlight kernels with their
element-wise epilogues; the TEs between them become grid-synchronized cooperative kernels, grid.py),
schedules (schedule.py), the nvcc build with a schedule fallback for code TVM or nvcc rejects, and each
kernel's launch, registers and shared memory (ptxas), which bound the cooperative grids. docs/gpu.md.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time

import tvm

from souffle_py.backends.base import Backend, Finished
from souffle_py.backends.cuda import nvcc, report, specs, tensor_cores, transplant
from souffle_py.backends.cuda.nvcc import cuda_source
from souffle_py.backends.cuda.barriers import grid_syncs_per_call
from souffle_py.backends.cuda.grid_stages import any_stage, in_grid, mark, selector
from souffle_py.backends.cuda.grid import grid_blocks, grid_size, stage_sources, with_grid
from souffle_py.backends.cuda.launches import launch_nests
from souffle_py.backends.cuda.occupancy import resident_blocks, stage_demands
from souffle_py.backends.cuda.partition import gpu_partition, prologues_of, unsynced
from souffle_py.backends.cuda.schedule import GRID_TILE, GpuScheduleError, gpu_schedules
from souffle_py.backends.cuda.warps import lane_reductions
from souffle_py.codegen.build import BuiltKernels, compile_functions, schedule_kernels
from souffle_py.codegen.merge import merged_kernel
from souffle_py.codegen.recurrence import close_back_edges
from souffle_py.errors import KernelFitError, SouffleError, TargetError
from souffle_py.failures import describe_exception, rule_failed
from souffle_py.partition import max_active_blocks_per_sm
from souffle_py.plan import Launch
from souffle_py.structural import StructuralMap
from souffle_py.ir.marks import member_of

NAMES = ("cuda", *specs.GPUS)
MAX_REBUILDS = 8
GPUS = specs.GPUS
log = logging.getLogger("souffle_py")


class CudaBackend(Backend):
    device = "cuda"
    approximates_math = False  # CUDA has fast exp/erf/tanh of its own (nvcc --use_fast_math)

    def __init__(self, target, spec):
        super().__init__(target, spec)
        self.arch = str(target.attrs.get("arch", "sm_90"))
        self._scheduled = StructuralMap()  # func (and stage records) -> its _Candidates
        self._stage_records = None   # the tuning database of grid kernels' GEMM stages (scheduler())
        self._in_grid = in_grid(target)  # op -> whether a grid kernel gives it a schedule of its own

    @classmethod
    def for_target(cls, target) -> "CudaBackend":
        return cls(*specs.resolve(target))

    # --- kernels ------------------------------------------------------------------------------------------
    def check_precision(self, precision):
        """fp16 / bf16: the operands of GEMMs and batch matmuls as real float16 / bfloat16 tensors, which the
        tensor-core schedules (tensor_cores.py) multiply with float32 accumulation (te_passes/precision.py,
        `Native`). Tensor cores take float16 from sm_70 (Volta) and bfloat16 from sm_80 (Ampere)."""
        if precision == "fp32":
            return
        needed = tensor_cores.MIN_ARCH.get(precision)
        if needed is None:
            raise TargetError(f"precision {precision!r} is not served on the GPU; use fp32, fp16 or bf16")
        if tensor_cores.sm_version(self.arch) < needed:
            raise TargetError(f"precision {precision!r} needs tensor cores of sm_{needed} or later for "
                              f"{tensor_cores.STORAGE[precision]} operands; the target's arch is {self.arch}: "
                              f"use fp32" + (" or fp16" if precision == "bf16" and
                                             tensor_cores.sm_version(self.arch) >= tensor_cores.MIN_ARCH["fp16"]
                                             else ""))

    def fused_kernels(self, program, fast_math, grid_sync: bool = True):
        """The GPU partition (partition.py): a large contraction that grid.py cannot tile keeps a tiled
        dlight kernel with its element-wise epilogue; the TEs between them (GEMMs on their own schedules,
        memory-intensive chains, small contractions, recurrences with their time loops) run as
        grid-synchronized kernels (grid.py), cut where occupancy says so. grid_sync=False launches each of those TEs as a kernel of its own instead
        (the ablation's "what grid sync saves")."""
        consumers = program.consumers()
        kernels = []
        for group in gpu_partition(program, self.spec, self._demands(program), self._in_grid):
            if group.kind == "tiled":
                kernels += self._tiled_kernels(program, group.ops, consumers, group.reason)
                continue
            if grid_sync:
                kernels += self._grid_or_fallback(program, group, consumers)
                continue
            parts = unsynced(group.ops)
            for i, ops in enumerate(parts):  # the same stages, one launch each; a recurrence a host loop
                reason = group.reason if i == 0 else f"grid_sync=False: part {i + 1} of {len(parts)} launched alone"
                kernels += (self._tiled_kernels(program, ops, consumers, reason) if member_of(ops[0])
                            else [self._grid_kernel(program, ops, consumers, reason, group.resident)])
        return kernels

    def _grid_or_fallback(self, program, group, consumers) -> list:
        """The grid kernel of `group`, else (its schedule failed: named by failures.rule_failed, an error in
        strict mode) its TEs as separate kernels, each cut reason naming the failure. A kernel whose GEMMs'
        prologues cannot be computed in their loads is first built again with them as stages."""
        grid = self._grid_kernel(program, group.ops, consumers, group.reason, group.resident)
        error, notes = self._grid_error(grid)
        reason = group.reason
        if error is not None and prologues_of(group.ops, program, consumers, self._in_grid):
            rule_failed("grid schedule", f"kernel {grid.name}", error, fallback="its GEMMs' prologues as stages")
            reason += "".join(f"; {note}" for note in notes) + f"; {report.PROLOGUES} after: {describe_exception(error)}"
            grid = self._grid_kernel(program, group.ops, consumers, reason, group.resident, prologues=False)
            error, notes = self._grid_error(grid)
        if error is None:
            return [dataclasses.replace(grid, reason=reason + "".join(f"; {note}" for note in notes))]
        parts = unsynced(group.ops)
        rule_failed("grid schedule", f"kernel {grid.name}", error,
                    fallback=f"its {len(group.ops)} TEs as {len(parts)} separate kernels")
        failed = f"{report.FAILED}: {describe_exception(error)}"
        return [kernel for i, ops in enumerate(parts) for kernel in self._tiled_kernels(
            program, ops, consumers, f"{group.reason}; {failed}" if i == 0 else
            f"{failed} (kernel {grid.name}, part {i + 1} of {len(parts)})")]

    def _tiled_kernels(self, program, ops, consumers, reason):
        """One dlight-scheduled kernel for `ops`, or one per TE when no GPU rule schedules them together."""
        name = (next((op.name for op in ops if op.reduce_axis), ops[0].name) if member_of(ops[0]) is None
                else member_of(ops[0]))
        kernel = merged_kernel(program, ops, consumers, name, reason=reason, fast_math=False)
        if len(ops) > 1 and member_of(ops[0]) is None and isinstance(self.default_schedule(kernel.func),
                                                                       GpuScheduleError):
            log.info("kernel %s (%s): no GPU rule schedules it as one function; one kernel per TE",
                     name, ", ".join(op.name for op in ops))
            alone = f"no GPU rule schedules kernel {name} as one function: its TEs one kernel each"
            return [merged_kernel(program, [op], consumers, op.name, reason=f"{reason}; {alone}" if i == 0 else
                                  f"{alone} ({i + 1} of {len(ops)})", fast_math=False) for i, op in enumerate(ops)]
        return [kernel]

    def _grid_error(self, kernel) -> tuple[Exception | None, list[str]]:
        """(None, fallbacks) when a grid schedule of `kernel` lowers (TVM's CUDA code generation, no nvcc):
        its GEMM stages on their own schedules, else on grid.py's tile (the failure named by
        failures.rule_failed, an error in strict mode, and listed in `fallbacks` for the kernel's
        reason); (the last candidate's error, fallbacks) when none does."""
        candidates = self._candidates(kernel.func)
        while not candidates.lowered:
            while candidates.failures:  # a schedule failed before the current candidate was made
                candidates.fallen_back(kernel.name, candidates.failures[0])
            if isinstance(candidates.current, GpuScheduleError):
                return candidates.error or candidates.current, candidates.notes
            error = _compile_error("grid", close_back_edges(candidates.current, kernel.loops), self.target)
            if error is None:
                candidates.lowered = True
                break
            candidates.reject()
            if isinstance(candidates.current, GpuScheduleError):  # the last one: its error for every twin
                candidates.error = error
                return error, candidates.notes
            candidates.fallen_back(kernel.name, error)
        return None, candidates.notes

    def _grid_kernel(self, program, ops, consumers, reason, resident: int | None = None,
                     blocks: int | None = None, prologues: bool = True):
        """The grid kernel of `ops`: `blocks` blocks, by default one wave of `resident` blocks per SM at
        most (by default the occupancy of its stages' largest demand); with `prologues`, the element-wise
        TEs read only by a GEMM stay inside it, computed in the GEMM's loads (grid.inline_prologues)."""
        name = f"grid_{ops[0].name}"
        kernel = merged_kernel(program, ops, consumers, name, reason=reason, fast_math=False,
                               global_intermediates=True,
                               local=prologues_of(ops, program, consumers, self._in_grid) if prologues else ())
        if resident is None:
            demand_of = self._demands(program)
            resident = resident_blocks([demand_of(op) for op in ops], self.spec)
        if resident == 0:
            raise KernelFitError(f"grid kernel {name}: the largest per-block demand among its stages "
                                 f"({', '.join(op.name for op in ops[:4])}{', ...' if len(ops) > 4 else ''}) "
                                 f"fits no SM of {self.spec.name}")
        blocks = blocks or grid_size(kernel.func, self.spec, per_sm=resident)[0]
        own = [f"s{i}" for i, op in enumerate(ops) if self._in_grid(op)]  # merge.py names stage i s<i>
        return dataclasses.replace(kernel, func=mark(with_grid(kernel.func, blocks, kernel.loops), own))

    def _demands(self, program):
        """op -> its demand as a stage of a grid kernel (occupancy.py): the GEMM stages' figures from
        ptxas in one nvcc call, the others' estimated when asked for."""
        gemms = [op for op in program.stages if self._in_grid(op)]
        demands = stage_demands(gemms, self.target, self.arch, any_stage, self._in_grid)

        def demand_of(op):
            if op not in demands:
                demands.update(stage_demands([op], self.target, self.arch, any_stage, self._in_grid))
            return demands[op]

        return demand_of

    # --- schedules ----------------------------------------------------------------------------------------
    def default_schedule(self, func):
        """The current GPU schedule of `func` (a GpuScheduleError, returned, when none binds it)."""
        return self._candidates(func).current

    def _candidates(self, func) -> "_Candidates":
        return self._scheduled.setdefault(func, lambda: _Candidates(func, self.target, self._stage_records),
                                          extra=id(self._stage_records))

    def _schedule_or_raise(self, func):
        result = self.default_schedule(func)
        if isinstance(result, GpuScheduleError):
            raise result
        return result

    def default_scheduler(self, kernels=()):
        return self._schedule_or_raise

    def scheduler(self, kernels, trials, database, quiet, runner=None):
        """MetaSchedule where tuned (tuning needs a GPU to measure on), else the default schedules. Tiled
        and unfused kernels are tuned whole; a grid-synchronized kernel's GEMM stages are tuned alone for
        the kernel's thread block against dlight's schedule, and the faster is transplanted into the
        kernel (transplant.py); the rest of a grid kernel's schedule is its launch nest. The budget is
        shared between the two kinds of task by their numbers."""
        from souffle_py.schedule import tuning

        database = database or tuning.default_database_dir()
        stage_target = transplant.stage_target(self.target)
        if trials > 0:
            if runner is None and not specs.gpu_present():
                raise SouffleError("tuning for cuda measures candidates on a GPU and this machine has none: "
                                   "measure on the GPU machines of an RPC tracker (runner=RpcTracker(...), "
                                   "souffle tune --rpc-tracker HOST:PORT --rpc-key KEY) or compile with "
                                   "trials=0 (default schedules, or the records of a database tuned on a GPU "
                                   "machine via database=)")
            tunable = {k.name: k.func for k in kernels
                       if grid_blocks(k.func) is None and tuning.is_compute_intensive(k.func)}
            stages = transplant.stage_tasks([k.func for k in kernels if grid_blocks(k.func) is not None], selector)
            stage_trials = trials * len(stages) // max(1, len(stages) + len(tunable))
            if tunable:
                tuning.tune(tunable, self.target, database, trials - stage_trials, quiet=quiet, runner=runner)
            if stages:
                tuning.tune(stages, stage_target, database, stage_trials, quiet=quiet,
                            baseline=transplant.dlight_baseline(self.target), runner=runner)
        self._stage_records = tuning.open_database(database, stage_target, create=False)
        return tuning.tuned_or_default(database, self.target, self._schedule_or_raise,
                                       accept=lambda func: grid_blocks(func) is None)

    # --- building -----------------------------------------------------------------------------------------
    def build(self, kernels, schedule, fast_math):
        """Schedule, compile, nvcc; a function that TVM or nvcc cannot compile gets its next schedule
        candidate (the last, one thread per output element, is plain code) and the module is rebuilt."""
        start = time.perf_counter()
        scheduled = schedule_kernels(kernels, schedule)
        for _ in range(MAX_REBUILDS):
            failing, error = self._compile(scheduled, fast_math)
            if not failing:
                built = BuiltKernels(module=error[0], function_of=scheduled.function_of,
                                     functions=scheduled.functions, distinct=len(scheduled.functions),
                                     seconds=time.perf_counter() - start)
                finished = self._finish(built, *error[1:])
                too_large = self._shrink_grids(scheduled, finished)
                if not too_large:
                    return built, finished
                for name in too_large:
                    scheduled.reschedule(name, schedule)
                continue
            for name in failing:
                candidates = self._candidates(scheduled.kernel_of[name].func)
                log.info("kernel %s: %s; trying its next GPU schedule", name, error)
                candidates.reject()
                scheduled.reschedule(name, schedule)
        raise SouffleError(f"the CUDA kernels do not compile after {MAX_REBUILDS} schedule fallbacks: {error}")

    def _compile(self, scheduled, fast_math):
        """([], (module, source, binary, resources)) or (failing function names, the error)."""
        try:
            module = compile_functions(scheduled.functions, self.target)
        except SouffleError as exc:
            failing = [name for name, func in scheduled.functions.items()
                       if not _compiles(name, func, self.target)]
            if not failing:
                raise
            return failing, f"TVM cannot compile it ({str(exc).strip().splitlines()[-1][:200]})"
        source = cuda_source(module)
        if not source:
            return [], (module, "", b"", {})
        try:
            binary, resources = nvcc.compile_cuda(source, (self.arch,), fast_math,
                                                  min_blocks_per_sm=self._grid_residency(scheduled.functions))
        except nvcc.NvccError as exc:
            failing = sorted({_function_of(kernel, scheduled.functions) for kernel in exc.kernels} - {None})
            if not failing:
                raise
            return failing, f"nvcc cannot compile it ({exc.first_error})"
        return [], (module, source, binary, resources)

    def _grid_residency(self, functions) -> dict[str, int]:
        """{device kernel: blocks per SM its cooperative grid needs resident}: its launch bounds, so that
        ptxas fits the kernel's registers to the grid instead of the grid being cut to the registers."""
        return {f"{name}_kernel": -(-grid_blocks(func) // self.spec.sms)
                for name, func in functions.items() if grid_blocks(func) is not None}

    def _shrink_grids(self, scheduled, finished) -> list[str]:
        """Grid kernels whose grid cannot be resident with the registers and shared memory ptxas reports:
        their kernel gets the grid that fits (its grid-stride loops cover the rest) for a rebuild."""
        too_large = []
        for name, launches in finished.launches.items():
            for launch in launches:
                if launch.cooperative and launch.blocks > self.spec.sms * (launch.resident_blocks_per_sm or 0):
                    fits = self.spec.sms * (launch.resident_blocks_per_sm or 0)
                    if fits == 0:
                        raise KernelFitError(f"kernel '{launch.kernel}' cannot run on {self.spec.name}: "
                                             f"{launch.threads} threads x {launch.registers} registers and "
                                             f"{launch.shared_bytes} B of shared memory per block fit no SM")
                    log.info("grid kernel %s: %d blocks > %d resident (%s registers); %d blocks", name,
                             launch.blocks, fits, launch.registers, fits)
                    kernel = scheduled.kernel_of[name]
                    scheduled.kernel_of[name] = dataclasses.replace(
                        kernel, func=with_grid(kernel.func, fits, kernel.loops))
                    too_large.append(name)
        return too_large

    def _finish(self, built, source, binary, resources) -> Finished:
        """Register the binary; per function its launches with ptxas's figures (grid kernels: cooperative,
        their grid barriers per call and their resident blocks per SM)."""
        if not source:
            return Finished()
        key = nvcc.source_key(source)
        nvcc.register_binary(key, binary)
        by_kernel = resources.get(self.arch, {})
        launches = {}
        for function, scheduled in built.functions.items():
            entries = []
            grid = grid_blocks(scheduled) is not None
            syncs = grid_syncs_per_call(scheduled) if grid else 0
            warps = len(lane_reductions(scheduled.body)) if grid else 0
            cooperative = syncs > 0
            for i, nest in enumerate(launch_nests(scheduled)):
                kernel = f"{function}_kernel" + (f"_{i}" if i else "")
                figures = by_kernel.get(kernel)
                resident = max_active_blocks_per_sm(self.spec, nest.threads, figures.registers,
                                                    figures.shared_bytes) if figures else None
                entries.append(Launch(
                    kernel=kernel, blocks=nest.blocks, threads=nest.threads, launches_per_call=nest.launches_per_call,
                    registers=figures.registers if figures else None,
                    shared_bytes=figures.shared_bytes if figures else None,
                    spill_bytes=figures.spill_bytes if figures else None,
                    resources_from=f"ptxas -v ({self.arch})" if figures else "",
                    cooperative=cooperative, grid_syncs=syncs, warp_reductions=warps,
                    resident_blocks_per_sm=resident, stage_schedules=stage_sources(scheduled), grid=grid))
            launches[function] = tuple(entries)
        return Finished(launches, key, binary, source)

    def describe(self) -> str:
        return (f"{self.spec.name} ({self.arch}, {self.spec.sms} SMs"
                + (", present" if specs.gpu_present() else ", no GPU here: compile only") + ")")


class _Candidates:
    """The GPU schedules of one function in rule order, made lazily; `reject` moves to the next."""

    def __init__(self, func, target, stage_records=None):
        self.func = func
        self.failures: list[Exception] = []  # schedules that failed before a fallback was made (unnamed yet)
        self.notes: list[str] = []           # the fallbacks taken, named (for the kernels' reasons)
        self.lowered = False                 # the current schedule is known to lower (a grid kernel's)
        self.error: Exception | None = None  # why the last one did not lower
        self._schedules = gpu_schedules(func, target, stage_records, self.failures)
        self.current = None
        self.reject()

    def fallen_back(self, kernel: str, exc: Exception) -> None:
        """Name a failed grid schedule whose kernel now has its GEMM stages on grid.py's tile."""
        if exc in self.failures:
            self.failures.remove(exc)
        rule_failed("grid schedule", f"kernel {kernel}", exc, fallback=GRID_TILE)
        self.notes.append(f"{report.TILE} after: {describe_exception(exc)}")

    def reject(self) -> None:
        try:
            self.current = next(self._schedules)[1]
        except GpuScheduleError as exc:
            self.current = exc
        except StopIteration:
            self.current = GpuScheduleError("every GPU schedule of this kernel failed to compile")


def _compiles(name, func, target) -> bool:
    return _compile_error(name, func, target) is None


def _compile_error(name, func, target) -> Exception | None:
    """Why TVM cannot compile `func` (None when it can)."""
    try:
        tvm.compile(tvm.IRModule({name: func}), target=target)
        return None
    except Exception as exc:  # noqa: BLE001  (any failure of TVM's lowering: the caller names it)
        return exc


def _function_of(kernel: str, functions) -> str | None:
    """The function whose device kernel is `kernel` (<symbol>_kernel or <symbol>_kernel_<n>)."""
    symbol = re.sub(r"_kernel(_\d+)?$", "", kernel)
    return symbol if symbol in functions else None
