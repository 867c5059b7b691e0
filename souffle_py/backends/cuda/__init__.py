"""NVIDIA GPUs (CUDA), part 1: one kernel per compute TE of the transformed program, with the element-wise
TEs that follow it as its epilogue, scheduled by dlight's GPU rules, compiled by nvcc and launched one
after another. Each kernel's launch, registers and shared memory are recorded for the occupancy-driven
partition and grid-synchronized merging of part 2.
"""

from __future__ import annotations

import logging
import re
import time

import tvm
import tvm_ffi

from souffle_py.backends import Backend, Finished
from souffle_py.backends.cuda import nvcc, specs
from souffle_py.backends.cuda.launches import launch_nests
from souffle_py.backends.cuda.schedule import GpuScheduleError, gpu_schedules
from souffle_py.codegen.build import BuiltKernels, compile_functions, schedule_kernels
from souffle_py.codegen.merge import merged_kernel
from souffle_py.errors import SouffleError
from souffle_py.plan import Launch
from te_passes.recurrence import member_of, recurrences

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
        self._scheduled: dict[int, list] = {}  # structural hash -> [(func, scheduled or the error)]

    @classmethod
    def for_target(cls, target) -> "CudaBackend":
        return cls(*specs.resolve(target))

    # --- kernels ------------------------------------------------------------------------------------------
    def fused_kernels(self, program, fast_math):
        """One kernel per compute TE (a TE with a reduction) and the element-wise TEs that read it, in
        program order; a group that no GPU rule schedules as one function falls back to one kernel per TE.
        A recurrence's step TEs make one kernel (its time loop)."""
        consumers = program.consumers()
        kernels = []
        for ops in _groups(program):
            name = ops[0].name if len(ops) == 1 or member_of(ops[0]) is None else member_of(ops[0])
            kernel = merged_kernel(program, ops, consumers, name, fast_math=False)
            if len(ops) > 1 and member_of(ops[0]) is None and isinstance(self.default_schedule(kernel.func),
                                                                           GpuScheduleError):
                log.info("kernel %s (%s): no GPU rule schedules it as one function; one kernel per TE",
                         name, ", ".join(op.name for op in ops))
                kernels += [merged_kernel(program, [op], consumers, op.name, fast_math=False) for op in ops]
                continue
            kernels.append(kernel)
        return kernels

    # --- schedules ----------------------------------------------------------------------------------------
    def default_schedule(self, func):
        """The current GPU schedule of `func` (a GpuScheduleError, returned, when none binds it)."""
        return self._candidates(func).current

    def _candidates(self, func) -> "_Candidates":
        key = tvm_ffi.structural_hash(func)
        bucket = self._scheduled.setdefault(key, [])
        found = next((c for c in bucket if tvm_ffi.structural_equal(c.func, func)), None)
        if found is None:
            found = _Candidates(func, self.target)
            bucket.append(found)
        return found

    def _schedule_or_raise(self, func):
        result = self.default_schedule(func)
        if isinstance(result, GpuScheduleError):
            raise result
        return result

    def default_scheduler(self):
        return self._schedule_or_raise

    def scheduler(self, kernels, trials, database, quiet):
        """MetaSchedule where tuned (tuning needs a GPU to measure on), else the default schedules."""
        from souffle_py.schedule import tuning

        database = database or tuning.default_database_dir()
        if trials > 0:
            if not specs.gpu_present():
                raise SouffleError("tuning for cuda measures candidates on a GPU and this machine has none: "
                                   "compile with trials=0 (default schedules, or the records of a database "
                                   "tuned on a GPU machine via database=)")
            tunable = {k.name: k.func for k in kernels if tuning.is_compute_intensive(k.func)}
            tuning.tune(tunable, self.target, database, trials, quiet=quiet)
        return tuning.tuned_or_default(database, self.target, self._schedule_or_raise)

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
                return built, self._finish(built, *error[1:])
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
        source = module.mod.imports[0].inspect_source() if module.mod.imports else ""
        if not source:
            return [], (module, "", b"", {})
        try:
            binary, resources = nvcc.compile_cuda(source, (self.arch,), fast_math)
        except nvcc.NvccError as exc:
            failing = sorted({_function_of(kernel, scheduled.functions) for kernel in exc.kernels} - {None})
            if not failing:
                raise
            return failing, f"nvcc cannot compile it ({exc.first_error})"
        return [], (module, source, binary, resources)

    def _finish(self, built, source, binary, resources) -> Finished:
        """Register the binary; per function its launches with ptxas's figures."""
        if not source:
            return Finished()
        key = nvcc.source_key(source)
        nvcc.register_binary(key, binary)
        by_kernel = resources.get(self.arch, {})
        launches = {}
        for function, scheduled in built.functions.items():
            entries = []
            for i, nest in enumerate(launch_nests(scheduled)):
                kernel = f"{function}_kernel" + (f"_{i}" if i else "")
                figures = by_kernel.get(kernel)
                entries.append(Launch(
                    kernel=kernel, blocks=nest.blocks, threads=nest.threads, launches_per_call=nest.launches_per_call,
                    registers=figures.registers if figures else None,
                    shared_bytes=figures.shared_bytes if figures else None,
                    spill_bytes=figures.spill_bytes if figures else None,
                    resources_from=f"ptxas -v ({self.arch})" if figures else ""))
            launches[function] = tuple(entries)
        return Finished(launches, key, binary, source)

    def describe(self) -> str:
        return (f"{self.spec.name} ({self.arch}, {self.spec.sms} SMs"
                + (", present" if specs.gpu_present() else ", no GPU here: compile only") + ")")


def _groups(program) -> list[list]:
    """Kernel groups of part 1: each TE with a reduction starts one; element-wise TEs join the current group
    when they read a tensor it computes (an epilogue), else start their own; a recurrence is one group."""
    loops = recurrences(program.stages)
    groups: list[list] = []
    current: list = []
    for op in program.stages:
        recurrence = member_of(op)
        if recurrence is not None:
            if op.same_as(loops[recurrence][0]):
                groups.append(list(loops[recurrence]))
                current = []
            continue
        reads_current = any(t.op in current for t in op.input_tensors)
        if current and not op.reduce_axis and reads_current:
            current.append(op)
            continue
        current = [op]
        groups.append(current)
    return groups


class _Candidates:
    """The GPU schedules of one function in rule order, made lazily; `reject` moves to the next."""

    def __init__(self, func, target):
        self.func = func
        self._schedules = gpu_schedules(func, target)
        self.current = None
        self.reject()

    def reject(self) -> None:
        try:
            self.current = next(self._schedules)[1]
        except GpuScheduleError as exc:
            self.current = exc
        except StopIteration:
            self.current = GpuScheduleError("every GPU schedule of this kernel failed to compile")


def _compiles(name, func, target) -> bool:
    try:
        tvm.compile(tvm.IRModule({name: func}), target=target)
        return True
    except Exception:
        return False


def _function_of(kernel: str, functions) -> str | None:
    """The function whose device kernel is `kernel` (<symbol>_kernel or <symbol>_kernel_<n>)."""
    symbol = re.sub(r"_kernel(_\d+)?$", "", kernel)
    return symbol if symbol in functions else None
