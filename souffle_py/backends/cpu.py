"""A CPU (LLVM; the host unless the target names another, cpu_target.py): cache-resident partitions merged
into one parallel function each, the rule-based
AVX-512/AVX2 schedules of schedule/default.py, GEMM weights packed into panels, MetaSchedule tuning of the
compute-intensive stages, replayed inside the merged kernels (schedule/staged.py)."""

from __future__ import annotations

import dataclasses
import functools
import logging

from souffle_py.backends.base import Backend
from souffle_py.backends.cpu_peak import measured_bf16_peak_gflops, measured_peak_gflops
from souffle_py.codegen.merge import merged_kernel
from souffle_py.cpu_target import CpuTarget, host_target, target_of, using  # noqa: F401  (host_target: re-exported)
from souffle_py.errors import InputError, TargetError
from souffle_py.failures import RuleFailedError, rule_failed
from souffle_py.host import num_threads
from souffle_py.partition import CacheResidentPolicy, cpu_spec, partition
from souffle_py.plan import ONE_THREAD_NOTE
from souffle_py.schedule.threads import runs_on_one_thread
from souffle_py.ir.analysis import analyze

NAMES = ("llvm", "cpu")
log = logging.getLogger("souffle_py")


class CpuBackend(Backend):
    device = "cpu"
    approximates_math = True  # LLVM lowers exp/erf/tanh to scalar libm calls (codegen/fast_math.py)

    @classmethod
    def for_target(cls, target) -> "CpuBackend":
        """The backend of `target`: "llvm"/"cpu" (the host), "llvm -mcpu=haswell ...", a JSON object, a dict
        or a tvm Target of kind llvm (cpu_target.target_of)."""
        resolved = target_of(target)
        return cls(resolved, cpu_spec(CpuTarget.from_target(resolved)))

    @functools.cached_property
    def cpu(self) -> CpuTarget:
        """What the schedule rules read of the target (`scope()` around every step below)."""
        return CpuTarget.from_target(self.target)

    def scope(self):
        """The CpuTarget the passes and rules read while they work for this backend."""
        return using(self.cpu)

    def check_precision(self, precision):
        """bf16: GEMM operands in bfloat16 for vdpbf16ps (AVX512_BF16; schedule/bf16_gemm.py), the
        convolutions' once their layouts are chosen (passes/cpu.py). fp16 has no CPU kernels: x86 has no
        float16 dot product short of AVX512_FP16, which these hosts lack."""
        cpu = self.target.attrs.get("mcpu", "llvm")
        if precision == "bf16" and not self.cpu.avx512_bf16:
            raise TargetError(f"precision 'bf16' needs AVX512_BF16 (vdpbf16ps), which the CPU '{cpu}' lacks: "
                              "use fp32, or a CPU with AVX512_BF16 (Intel Cooper Lake, Sapphire Rapids and "
                              "later; AMD Zen 4 and later)")
        if precision not in ("fp32", "bf16"):
            raise TargetError(f"precision {precision!r} is not served on the CPU ('{cpu}'): float16 GEMMs need "
                              "AVX512_FP16, and souffle-py has no CPU float16 kernels; use bf16 or fp32")

    def fused_kernels(self, program, fast_math, grid_sync=True):
        """Cache-resident subprograms (partition.py), each merged into one function."""
        with self.scope():
            parts = partition(analyze(program), program.stages, CacheResidentPolicy.for_spec(self.spec))
            log.info("partitioned %d TEs into %d subprograms", len(program.stages), len(parts.subprograms))
            consumers = program.consumers()
            return [merged_kernel(program, sub.ops, consumers, f"sub{i}", reason=sub.reason, fast_math=fast_math)
                    for i, sub in enumerate(parts.subprograms)]

    def scheduler(self, kernels, trials, database, quiet, runner=None):
        """Tune what is asked for, then schedule each kernel: the best record of each compute-intensive
        stage (the default schedule competes in the database) replayed on it, the defaults elsewhere."""
        from souffle_py.schedule import staged, variants  # MetaSchedule: only imported when a database is consulted
        from souffle_py.schedule.tuning import default_database_dir

        database = database or default_database_dir()
        with self.scope():
            if trials > 0:
                staged.tune_stages(kernels, self.target, database, trials, quiet=quiet, runner=runner)
            provisional = variants.provisional_database()  # close choices: this compile's only
            try:  # a few default variants of the large stages, measured once (schedule/variants.py)
                variants.choose_variants(kernels, self.target, database, quiet=quiet, provisional=provisional)
            except Exception as exc:  # noqa: BLE001  (a builder or runner that fails leaves the default rules)
                rule_failed("schedule variants", "this model's large stages", exc, "the default rules")
        return _guarded(staged.staged_scheduler(database, self.target, one_thread=_one_thread(kernels),
                                                extra=[provisional]), self.cpu)

    def default_scheduler(self, kernels=()):
        from souffle_py.schedule.default import schedule_cpu

        return _guarded(functools.partial(schedule_cpu, one_thread=_one_thread(kernels)), self.cpu)

    def describe(self) -> str:
        if self.cpu.host:
            return f"host CPU ({self.target.attrs.get('mcpu', 'llvm')}, {num_threads()} threads)"
        return f"CPU {self.cpu.cpu} ({self.cpu.arch}, {self.cpu.vector_bits}-bit vectors, {self.cpu.threads} threads)"

    def peak_gflops(self, single_threaded: bool = False, precision: str = "fp32") -> float:
        """Measured on the host's threads (cpu_peak.py): a shared host does not hold a datasheet clock.
        bf16: the vdpbf16ps chain's rate."""
        threads = 1 if single_threaded else num_threads()
        if precision == "bf16":
            return measured_bf16_peak_gflops(self.target, threads)
        return measured_peak_gflops(self.target, threads)

    def build(self, kernels, schedule, fast_math):
        """The base build; a model of little work says in its plan that it runs on one thread."""
        with self.scope():
            built, finished = super().build(kernels, schedule, fast_math)
        if _one_thread(kernels):
            log.info(ONE_THREAD_NOTE)
            finished = dataclasses.replace(finished, notes=finished.notes + (ONE_THREAD_NOTE,))
        return built, finished


def _guarded(schedule, cpu: CpuTarget):
    """`schedule` for `cpu` (the rules read it: cpu_target.using), under the failure policy (failures.py): a
    kernel whose scheduling raises keeps its loops as merged (serial: correct, and slow), with a warning
    naming its blocks; in strict mode, an error. The rules catch their own failures first, so this is the
    last line."""
    def run(func):
        try:
            with using(cpu):
                return schedule(func)
        except RuleFailedError:
            raise
        except Exception as exc:  # noqa: BLE001  (the failure policy)
            blocks = [b.name_hint for b in _root_blocks(func)]
            subject = f"the kernel of {', '.join(blocks[:4])}" + (", ..." if len(blocks) > 4 else "")
            rule_failed("the CPU schedule", subject, exc, "its loops unscheduled")
            return func
    return run


def _root_blocks(func) -> list:
    from tvm import s_tir

    sch = s_tir.Schedule(func)
    return [sch.get(b) for b in sch.get_child_blocks(sch.get_sblock("root"))]


def _one_thread(kernels) -> bool:
    """Whether the model is too little work for threads (schedule/threads.py, runs_on_one_thread)."""
    return bool(kernels) and runs_on_one_thread([k.func for k in kernels])
