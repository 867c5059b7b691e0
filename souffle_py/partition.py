"""Resource-aware partitioning of a TE program into subprograms (paper section 5.4, Algorithm 1).

The walk is in topological order; a cut may only fall *before a compute-intensive TE* (memory-intensive
TEs always join the subprogram of the TEs around them, where their traffic can stay on chip). Whether to
cut is the target's resource policy's call; every cut records the policy's reason.

Legality ("may these share a kernel?") is the topological walk itself: a subprogram is a contiguous run of
the order, so every producer is in an earlier or the same subprogram. The policies decide worth/fit.

- CPU (`CacheResidentPolicy`): a subprogram keeps growing while the bytes it touches — the weights its TEs
  read plus the peak of its live intermediates — fit in the last-level cache. Inside such a subprogram the
  producer-consumer traffic between stages stays in cache; past it, merging buys no locality, and cutting
  keeps each kernel (and each tuning task) about one repeated block of the model, so identical blocks such
  as BERT's layers become identical kernels compiled and tuned once. Each stage of a CPU kernel is its own
  parallel loop nest, so no cross-stage synchronization limits the subprogram's size; compile time does:
  TVM's scheduling and lowering grow quadratically with the stages of one PrimFunc (measured: 244 stages
  take 2.3 s to schedule and 3.2 s to compile, 3020 would take minutes), so a subprogram also stops at
  `max_stages`.
- CUDA (`OccupancyPolicy`): the grid-sync rule of the paper's Algorithm 1 for stages with fixed grids.
  All stages of a subprogram run in one cooperative launch separated by grid-wide barriers, so every block
  of the launch must be resident at once:
  blocks(subprogram) <= SMs * max_active_blocks_per_SM(threads, registers, shared memory).
  The CUDA backend's grid kernels (backends/cuda/grid.py) run every stage in grid-stride loops, so any grid
  is correct: there (`grid_stride=True`) the occupancy formula sizes the grid (one wave) and cuts only
  where a stage's demand would shrink that wave below what the other stages need
  (backends/cuda/partition.py, with each stage's figures from backends/cuda/occupancy.py).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from tvm import te

from souffle_py.cpu_target import CpuTarget
from souffle_py.ir.analysis import ProgramAnalysis, TEInfo
from souffle_py.ir.marks import member_of


@dataclass(frozen=True)
class HardwareSpec:
    """What the resource policies need to know about a machine."""

    name: str
    kind: str                          # "gpu" or "cpu"
    sms: int = 0                       # GPU: streaming multiprocessors
    max_threads_per_sm: int = 0
    max_blocks_per_sm: int = 0
    registers_per_sm: int = 0
    shared_memory_per_sm: int = 0      # bytes
    max_shared_memory_per_block: int = 0
    cores: int = 0                     # CPU
    l2_bytes_per_core: int = 0
    llc_bytes: int = 0                 # last-level cache


A100 = HardwareSpec("A100", "gpu", sms=108, max_threads_per_sm=2048, max_blocks_per_sm=32,
                    registers_per_sm=65536, shared_memory_per_sm=164 * 1024, max_shared_memory_per_block=163 * 1024)
H100 = HardwareSpec("H100", "gpu", sms=132, max_threads_per_sm=2048, max_blocks_per_sm=32,
                    registers_per_sm=65536, shared_memory_per_sm=228 * 1024, max_shared_memory_per_block=227 * 1024)
H200 = HardwareSpec("H200", "gpu", sms=132, max_threads_per_sm=2048, max_blocks_per_sm=32,
                    registers_per_sm=65536, shared_memory_per_sm=228 * 1024, max_shared_memory_per_block=227 * 1024)


def cpu_spec(cpu: CpuTarget) -> HardwareSpec:
    """The policies' view of a CPU target: its threads and caches (cpu_target.py)."""
    return HardwareSpec(f"{cpu.cpu} CPU", "cpu", cores=cpu.threads, l2_bytes_per_core=cpu.l2_bytes,
                        llc_bytes=cpu.l3_bytes)


def host_cpu() -> HardwareSpec:
    return cpu_spec(CpuTarget.host_cpu())


# --- the occupancy rule -----------------------------------------------------------------------------------
def max_active_blocks_per_sm(spec: HardwareSpec, threads_per_block: int, registers_per_thread: int,
                             shared_memory_per_block: int) -> int:
    """CUDA's occupancy calculation: the blocks of one kernel that fit on an SM at once (0: it cannot run)."""
    if threads_per_block <= 0 or threads_per_block > 1024 or shared_memory_per_block > spec.max_shared_memory_per_block:
        return 0
    warps = -(-threads_per_block // 32)
    by_threads = spec.max_threads_per_sm // (warps * 32)
    regs_per_warp = -(-registers_per_thread * 32 // 256) * 256  # registers are allocated per warp, 256 at a time
    by_registers = spec.registers_per_sm // (regs_per_warp * warps) if registers_per_thread else spec.max_blocks_per_sm
    by_smem = spec.shared_memory_per_sm // shared_memory_per_block if shared_memory_per_block else spec.max_blocks_per_sm
    return max(0, min(spec.max_blocks_per_sm, by_threads, by_registers, by_smem))


@dataclass(frozen=True)
class LaunchConfig:
    """How one TE runs on the GPU once scheduled: grid size and per-block resources."""

    blocks: int
    threads_per_block: int
    registers_per_thread: int = 32
    shared_memory_per_block: int = 0


def estimated_launch(info: TEInfo, threads_per_block: int = 256, elements_per_thread: int = 4) -> LaunchConfig:
    """A launch estimate for an unscheduled TE: one thread per few output elements (the CUDA schedules,
    a later stage, replace this with the real launch configuration)."""
    threads = -(-info.points // elements_per_thread)
    return LaunchConfig(blocks=max(1, -(-threads // threads_per_block)), threads_per_block=threads_per_block)


# --- policies ---------------------------------------------------------------------------------------------
class Policy(Protocol):
    """Decides, at a compute-intensive TE, whether it still fits the current subprogram."""

    def reset(self) -> None: ...

    def admit(self, info: TEInfo, analysis: ProgramAnalysis) -> str | None:
        """Add the TE to the current subprogram's budget; return a cut reason instead if it does not fit."""

    def add(self, info: TEInfo, analysis: ProgramAnalysis) -> None:
        """Account a TE that joins the current subprogram unconditionally (memory-intensive TEs)."""


@dataclass
class CacheResidentPolicy:
    """CPU: weights read + peak live intermediates of a subprogram must fit in `budget_bytes` (the LLC),
    and it holds at most `max_stages` TEs (compile time)."""

    budget_bytes: int
    max_stages: int = 64
    _stages: int = 0
    _weights: set = field(default_factory=set)
    _weight_bytes: int = 0
    _live: list = field(default_factory=list)   # heap of (last use, bytes) of intermediates produced here
    _live_bytes: int = 0
    _peak: int = 0

    @classmethod
    def for_spec(cls, spec: HardwareSpec) -> "CacheResidentPolicy":
        return cls(budget_bytes=spec.llc_bytes)

    def reset(self) -> None:
        self._weights, self._weight_bytes, self._live, self._live_bytes, self._peak = set(), 0, [], 0, 0
        self._stages = 0

    def _footprint_with(self, info: TEInfo, analysis: ProgramAnalysis) -> tuple[int, int]:
        """(weights, peak live intermediates) of the subprogram if `info` joins it (TEs come in order)."""
        while self._live and self._live[0][0] < info.index:  # intermediates dead before this TE
            self._live_bytes -= heapq.heappop(self._live)[1]
        weights = sum(analysis.tensors[a.tensor].bytes for a in info.accesses
                      if analysis.tensors[a.tensor].kind == "param" and a.tensor not in self._weights)
        return self._weight_bytes + weights, max(self._peak, self._live_bytes + info.bytes)

    def admit(self, info: TEInfo, analysis: ProgramAnalysis) -> str | None:
        weights, peak = self._footprint_with(info, analysis)
        if self._weight_bytes and weights + peak > self.budget_bytes:
            return (f"cache: weights {weights / 2**20:.1f} MiB + live intermediates {peak / 2**20:.1f} MiB "
                    f"would exceed the {self.budget_bytes / 2**20:.0f} MiB last-level cache")
        if self._stages >= self.max_stages:
            return f"compile size: {self._stages} TEs already (limit {self.max_stages} per kernel)"
        self.add(info, analysis)
        return None

    def add(self, info: TEInfo, analysis: ProgramAnalysis) -> None:
        self._weight_bytes, self._peak = self._footprint_with(info, analysis)
        for access in info.accesses:
            if analysis.tensors[access.tensor].kind == "param":
                self._weights.add(access.tensor)
        heapq.heappush(self._live, (analysis.tensors[info.name].live[1], info.bytes))
        self._live_bytes += info.bytes
        self._stages += 1


@dataclass
class OccupancyPolicy:
    """CUDA grid-sync rule: every block of the cooperative launch must be resident at once.

    With fixed grids (the paper's kernels: `grid_stride` False) a subprogram is cut before a
    compute-intensive TE once its blocks exceed one wave at the largest per-block demand. With stages
    that loop over their work (grid.py: `grid_stride` True) any grid is correct, so a cut is made only
    where it pays: before a TE whose demand shrinks the wave below the blocks the subprogram's stages
    already need (they would take extra rounds that they do not take without it), or that no SM can
    hold beside them. `launch_of` gives a TE's (or any item's) launch."""

    spec: HardwareSpec
    launch_of: Callable[[TEInfo], LaunchConfig] = estimated_launch
    grid_stride: bool = False
    _blocks: int = 0
    _threads: int = 0
    _registers: int = 0
    _smem: int = 0

    def reset(self) -> None:
        self._blocks = self._threads = self._registers = self._smem = 0

    def _merged(self, launch: LaunchConfig) -> tuple[int, int, int, int]:
        """One launch runs every stage: the largest grid and the largest per-block needs among them."""
        return (max(self._blocks, launch.blocks), max(self._threads, launch.threads_per_block),
                max(self._registers, launch.registers_per_thread), max(self._smem, launch.shared_memory_per_block))

    def capacity(self, threads: int, registers: int, smem: int) -> int:
        return self.spec.sms * max_active_blocks_per_sm(self.spec, threads, registers, smem)

    @property
    def resident_blocks_per_sm(self) -> int:
        """Blocks per SM of the subprogram so far (its largest demand)."""
        return self.capacity(self._threads, self._registers, self._smem) // self.spec.sms if self._blocks else 0

    def admit(self, info, analysis: ProgramAnalysis | None = None) -> str | None:
        launch = self.launch_of(info)
        blocks, threads, registers, smem = self._merged(launch)
        limit = self.capacity(threads, registers, smem)
        if self._blocks and not self.grid_stride and blocks > limit:
            return (f"occupancy: {blocks} blocks > {self.spec.sms} SMs x "
                    f"{limit // self.spec.sms} resident blocks per SM on {self.spec.name}")
        if self._blocks and self.grid_stride:
            current = self.capacity(self._threads, self._registers, self._smem)
            if limit == 0 or (self._blocks > limit and limit < current):
                return (f"occupancy: its {launch.registers_per_thread} registers/thread and "
                        f"{launch.shared_memory_per_block} B shared/block leave {limit // self.spec.sms} "
                        f"resident blocks per SM on {self.spec.name} ({current // self.spec.sms} without it): "
                        f"a wave of {limit} blocks, fewer than the {self._blocks} blocks a round of the "
                        f"kernel's stages takes")
        self.add(info, analysis)
        return None

    def add(self, info, analysis: ProgramAnalysis | None = None) -> None:
        self._blocks, self._threads, self._registers, self._smem = self._merged(self.launch_of(info))


def policy_for(target_kind: str, spec: HardwareSpec | None = None) -> Policy:
    if target_kind == "cuda":
        return OccupancyPolicy(spec or A100)
    return CacheResidentPolicy.for_spec(spec or host_cpu())


# --- the partition ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Subprogram:
    """A contiguous run of TEs that becomes one kernel, and why it starts where it does."""

    ops: tuple[te.ComputeOp, ...]
    reason: str

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(op.name for op in self.ops)


@dataclass(frozen=True)
class Partition:
    subprograms: tuple[Subprogram, ...]

    def describe(self) -> str:
        lines = []
        for i, sub in enumerate(self.subprograms):
            lines.append(f"subprogram {i}: {len(sub.ops)} TEs {sub.names[0]} .. {sub.names[-1]} ({sub.reason})")
        return "\n".join(lines)


def partition(analysis: ProgramAnalysis, stages: Sequence[te.ComputeOp], policy: Policy) -> Partition:
    """Cut `stages` (topological order) into subprograms, only before compute-intensive TEs."""
    policy.reset()
    subprograms: list[Subprogram] = []
    current: list[te.ComputeOp] = []
    reason = "program start"
    for op in stages:
        info = analysis.te_of(op)
        if info.klass == "CI" and current and not _continues_recurrence(op, current):
            cut = policy.admit(info, analysis)
            if cut is not None:
                subprograms.append(Subprogram(tuple(current), reason))
                current, reason = [], f"cut before CI TE {info.name}: {cut}"
                policy.reset()
                policy.add(info, analysis)
        else:
            policy.add(info, analysis)
        current.append(op)
    if current:
        subprograms.append(Subprogram(tuple(current), reason))
    return Partition(tuple(subprograms))


def _continues_recurrence(op: te.ComputeOp, current: Sequence[te.ComputeOp]) -> bool:
    """A recurrence's step TEs share one time loop, so never cut between them."""
    name = member_of(op)
    return name is not None and any(member_of(other) == name for other in current)
