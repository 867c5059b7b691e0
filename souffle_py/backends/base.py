"""The interface every target implements (`Backend`) and what a build leaves besides the library
(`Finished`); the package's __init__ picks the backend of a target (`backend_for`). A module of its own so
that the backends import it without importing the package that imports them."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Sequence

import tvm
from tvm import tirx

from souffle_py.codegen.build import build_kernels
from souffle_py.codegen.kernels import Kernel
from souffle_py.codegen.unfused import unfused_kernels
from souffle_py.errors import TargetError
from souffle_py.partition import HardwareSpec
from souffle_py.plan import Launch
from souffle_py.ir.program import TEProgram

Schedule = Callable[[tirx.PrimFunc], tirx.PrimFunc]


class Backend:
    """The target-specific steps of the pipeline; subclasses fill them in."""

    device: str = ""                 # the runtime's device kind: "cpu" or "cuda"
    approximates_math: bool = False  # kernels get topi's float32 approximations (codegen/fast_math.py)

    def __init__(self, target: tvm.target.Target, spec: HardwareSpec):
        self.target = target
        self.spec = spec

    def scope(self):
        """A context the passes and rules of this target run in (the CPU's: its CpuTarget); none here."""
        return contextlib.nullcontext()

    def check_precision(self, precision: str) -> None:
        """Raise TargetError unless this target serves the mixed-precision policy `precision`
        (te_passes/precision.py); "fp32" is exact and served everywhere."""
        if precision != "fp32":
            raise TargetError(f"precision {precision!r} is not implemented for {self.describe()}: use fp32")

    # The rewrites themselves are the target's registered passes (souffle_py/passes), not backend code.

    def fused_kernels(self, program: TEProgram, fast_math: bool, grid_sync: bool = True) -> list[Kernel]:
        """The partitioned, merged kernels; grid_sync=False (GPU) launches the stages of each
        grid-synchronized kernel separately instead (an ablation)."""
        raise NotImplementedError

    def unfused_kernels(self, program: TEProgram, fast_math: bool) -> list[Kernel]:
        """Every TE its own kernel (the unfused reference)."""
        return unfused_kernels(program, fast_math and self.approximates_math)

    def scheduler(self, kernels: Sequence[Kernel], trials: int, database, quiet: bool, runner=None) -> Schedule:
        """Tune what is asked for (measured on the servers of `runner`, an RpcTracker, when given); then
        tuned schedules where the database has them, else the defaults."""
        raise NotImplementedError

    def default_scheduler(self, kernels: Sequence[Kernel] = ()) -> Schedule:
        """The rule-based default schedules alone (no database), for `kernels` (the whole model's)."""
        raise NotImplementedError

    def build(self, kernels: Sequence[Kernel], schedule: Schedule, fast_math: bool):
        """(BuiltKernels, Finished): schedule and compile the kernels, then what the target needs after."""
        return build_kernels(kernels, self.target, schedule), Finished()

    def describe(self) -> str:
        return f"{self.spec.name} ({self.target.kind.name})"

    def peak_gflops(self, single_threaded: bool = False, precision: str = "fp32") -> float | None:
        """The rate the profile rates kernel calls against (GFLOP/s): float32 FMAs, or the reduced-precision
        dot products of `precision`; of one core for a model whose kernels run on one thread; None where it
        is not known."""
        return None


@dataclass(frozen=True)
class Finished:
    """What a build leaves besides the library: device launches by function name, the device binary's
    key, the binary and its source (GPU targets)."""

    launches: dict[str, tuple[Launch, ...]] = field(default_factory=dict)
    binary_key: str = ""
    binary: bytes = b""
    source: str = ""
    notes: tuple[str, ...] = ()
