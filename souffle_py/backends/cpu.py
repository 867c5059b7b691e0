"""The host CPU (LLVM): cache-resident partitions merged into one parallel function each, the rule-based
AVX-512/AVX2 schedules of schedule/default.py, GEMM weights packed into panels, MetaSchedule tuning of the
compute-intensive stages, replayed inside the merged kernels (schedule/staged.py)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os

import tvm
import tvm_ffi

from souffle_py.backends.base import Backend
from souffle_py.backends.cpu_peak import measured_bf16_peak_gflops, measured_peak_gflops
from souffle_py.codegen.merge import merged_kernel
from souffle_py.errors import InputError, TargetError
from souffle_py.failures import RuleFailedError, rule_failed
from souffle_py.host import missing_cpu_features, num_threads
from souffle_py.partition import CacheResidentPolicy, host_cpu, partition
from souffle_py.plan import ONE_THREAD_NOTE
from souffle_py.schedule.conv import CONV_MAX_LANES
from souffle_py.schedule.default import TILE_J, VECTOR
from souffle_py.schedule.gates import group_units
from souffle_py.schedule.threads import runs_on_one_thread
from te_passes.analysis import analyze
from te_passes.batch_lanes import batches_in_lanes
from te_passes.channel_blocks import block_conv_networks
from te_passes.conv_layout import block_depthwise_inputs, pad_filters, separate_depthwise_operands, widen_weight_blocks
from te_passes.depthwise_blocks import block_depthwise_outputs
from te_passes.flat_reductions import split_flat_reductions
from te_passes.gemm_columns import pad_gemm_columns
from te_passes.gate_projections import group_gate_projections, mark_gate_cells
from te_passes.layout import pack_weights, transpose_operands
from te_passes.precision import reduce_precision
from te_passes.precision_conv import reduce_conv_precision
from te_passes.small_groups import densify_small_groups
from te_passes.squeeze_excite import fold_channel_scales
from te_passes.unit_rows import lift_1d_convs

NAMES = ("llvm", "cpu")
log = logging.getLogger("souffle_py")
# the cores this process may run on, before TVM's thread pool pins its threads (set_num_threads)
_ALLOWED_CPUS = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None


def set_num_threads(count: int) -> None:
    """Run CPU kernels on `count` threads from now on (TVM_NUM_THREADS only counts when TVM starts its thread
    pool). On cores shared with other work, use the ones you can count on: TVM shares each parallel loop
    out statically, so a preempted thread stalls every launch (BERT-base beside one busy process on 2
    cores: 746 ms on 2 threads, 179 ms on one)."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise InputError(f"set_num_threads() needs a positive number of threads, got {count!r}")
    os.environ["TVM_NUM_THREADS"] = str(count)  # num_threads(), new targets and ONNX Runtime baselines follow
    if _ALLOWED_CPUS:  # a pool of one pins this thread to one core, and TVM sizes a new pool by its affinity
        os.sched_setaffinity(0, _ALLOWED_CPUS)
    tvm_ffi.get_global_func("runtime.config_threadpool")(1, count)  # 1: TVM's default affinity mode (big cores)


def host_target() -> tvm.target.Target:
    """The host CPU with its vector extensions and core count (TVM 0.27 rejects "llvm -num-cores 2"), plus
    the extensions its CPUID flags show but LLVM's name for it lacks (host.missing_cpu_features)."""
    cpu, extra = _host_cpu()
    return tvm.target.Target({"kind": "llvm", "mcpu": cpu, "num-cores": num_threads(),
                              **({"mattr": list(extra)} if extra else {})})


@functools.cache
def _host_cpu() -> tuple[str, tuple[str, ...]]:
    """LLVM's name for the host CPU and the features to add to it (read once per process)."""
    cpu = tvm.target.codegen.llvm_get_system_cpu()
    plain = tvm.target.Target({"kind": "llvm", "mcpu": cpu})
    reported = {str(name) for name in tvm.target.codegen.llvm_get_cpu_features(plain)}
    return cpu, tuple(missing_cpu_features(reported))


class CpuBackend(Backend):
    device = "cpu"
    approximates_math = True  # LLVM lowers exp/erf/tanh to scalar libm calls (codegen/fast_math.py)

    @classmethod
    def for_target(cls, target) -> "CpuBackend":
        resolved = target if isinstance(target, tvm.target.Target) else host_target()
        return cls(resolved, host_cpu())

    def reduce_precision(self, program, precision):
        """bf16: GEMM operands in bfloat16 for vdpbf16ps (AVX512_BF16; schedule/bf16_gemm.py); the
        convolutions' follow in `prepare`, once their layouts are chosen (precision_conv.py). fp16 has no
        CPU kernels: x86 has no float16 dot product short of AVX512_FP16, which these hosts lack."""
        if precision == "fp32":
            return program
        cpu = self.target.attrs.get("mcpu", "llvm")
        if precision == "bf16":
            if not tvm.target.codegen.target_has_features("avx512bf16", self.target):
                raise TargetError(f"precision 'bf16' needs AVX512_BF16 (vdpbf16ps), which the CPU '{cpu}' lacks: "
                                  "use fp32, or a CPU with AVX512_BF16 (Intel Cooper Lake, Sapphire Rapids and "
                                  "later; AMD Zen 4 and later)")
            return reduce_precision(program, precision)
        raise TargetError(f"precision {precision!r} is not served on the CPU ('{cpu}'): float16 GEMMs need "
                          "AVX512_FP16, and souffle-py has no CPU float16 kernels; use bf16 or fp32")

    def prepare(self, program, precision="fp32"):
        program = lift_1d_convs(program)  # 1-D conv networks as 2-D ones over one row, for the layouts below
        program = split_flat_reductions(program)  # sums over reshaped maps over their factors (GroupNorm(1))
        program = pad_gemm_columns(program, TILE_J)  # ragged GEMM columns as whole panels (gemm_columns.py)
        program = pack_weights(program, TILE_J)  # the default GEMM's weight layout (te_passes/layout.py)
        program = transpose_operands(program)  # computed GEMM operands read across columns (Q.K^T)
        program = batches_in_lanes(program, VECTOR)  # attention over 7 x 7 windows: pairs in lanes
        program = group_gate_projections(mark_gate_cells(program), group_units)  # an LSTM step by unit groups
        program = widen_weight_blocks(program, CONV_MAX_LANES)  # the dense conv's register tile (conv_layout.py)
        program = fold_channel_scales(program)  # squeeze-excite gates scale the project conv's weight instead
        program = densify_small_groups(program, VECTOR // 4)  # 4-channel groups as dense 16-channel blocks
        # NCHWc maps from conv to conv, depthwise and 1x1 project convs included, channels padded up to the
        # block (channel_blocks.py)
        program = block_conv_networks(program, CONV_MAX_LANES)
        # depthwise convs left in NCHW (a reader outside the blocks): channel-blocked input and output, the
        # input a blocked padded copy where a pad and activation were composed into it
        program = block_depthwise_outputs(block_depthwise_inputs(separate_depthwise_operands(program), VECTOR),
                                          VECTOR)
        program = pad_filters(program, CONV_MAX_LANES, VECTOR)  # convs left in NCHW: whole vectors of filters
        if precision == "bf16":  # the convolutions in their final layouts, on vdpbf16ps (precision_conv.py)
            program = reduce_conv_precision(program)
        return program

    def fused_kernels(self, program, fast_math, grid_sync=True):
        """Cache-resident subprograms (partition.py), each merged into one function."""
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
        if trials > 0:
            staged.tune_stages(kernels, self.target, database, trials, quiet=quiet, runner=runner)
        try:  # a few default variants of the large stages, measured once (schedule/variants.py)
            variants.choose_variants(kernels, self.target, database, quiet=quiet)
        except Exception as exc:  # noqa: BLE001  (a builder or runner that fails leaves the default rules)
            rule_failed("schedule variants", "this model's large stages", exc, "the default rules")
        return _guarded(staged.staged_scheduler(database, self.target, one_thread=_one_thread(kernels)))

    def default_scheduler(self, kernels=()):
        from souffle_py.schedule.default import schedule_cpu

        return _guarded(functools.partial(schedule_cpu, one_thread=_one_thread(kernels)))

    def describe(self) -> str:
        return f"host CPU ({self.target.attrs.get('mcpu', 'llvm')}, {num_threads()} threads)"

    def peak_gflops(self, single_threaded: bool = False, precision: str = "fp32") -> float:
        """Measured on the host's threads (cpu_peak.py): a shared host does not hold a datasheet clock.
        bf16: the vdpbf16ps chain's rate."""
        threads = 1 if single_threaded else num_threads()
        if precision == "bf16":
            return measured_bf16_peak_gflops(self.target, threads)
        return measured_peak_gflops(self.target, threads)

    def build(self, kernels, schedule, fast_math):
        """The base build; a model of little work says in its plan that it runs on one thread."""
        built, finished = super().build(kernels, schedule, fast_math)
        if _one_thread(kernels):
            log.info(ONE_THREAD_NOTE)
            finished = dataclasses.replace(finished, notes=finished.notes + (ONE_THREAD_NOTE,))
        return built, finished


def _guarded(schedule):
    """`schedule` under the failure policy (failures.py): a kernel whose scheduling raises keeps its loops
    as merged (serial: correct, and slow), with a warning naming its blocks; in strict mode, an error. The
    rules catch their own failures first, so this is the last line."""
    def run(func):
        try:
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
