"""What a CUDA model's kernels came to, from its execution plan: device launches per inference, grid kernels
(one launch nest for all their stages, cooperative where a stage needs a grid barrier), grid barriers, the
share of the program's TEs inside grid kernels, and every fallback by kernel and reason.

A fallback is a grid kernel that could not be built as planned (backends/cuda/__init__.py names them in
the kernel's cut reason, and failures.rule_failed warns, or raises in strict mode):
- FAILED: its grid schedule failed, and its TEs run as separate kernels;
- PROLOGUES: its GEMMs' prologues could not be computed in their loads and are stages of their own;
- TILE: its GEMM stages' own schedules failed, and they take grid.py's tile.
`describe()`, `souffle compile` and scripts/bench_corpus.py's CUDA column print these figures.
"""

from __future__ import annotations

from dataclasses import dataclass

from souffle_py.plan import ExecutionPlan

FAILED = "grid schedule failed"
PROLOGUES = "prologues as stages"
TILE = "GEMM stages on grid.py's tile"


@dataclass(frozen=True)
class GridFigures:
    launches: int          # device kernel launches per inference
    calls: int             # kernel calls per inference
    grid_kernels: int      # calls that are one grid launch nest (cooperative or not)
    cooperative: int       # grid kernels launched cooperatively (a grid barrier inside)
    grid_syncs: int        # grid barriers per inference
    tes: int               # TEs of the program (over all calls)
    grid_tes: int          # TEs inside grid kernels
    fallbacks: tuple[tuple[str, str], ...]  # (kernel call, its reason) for every fallback

    @property
    def share(self) -> float:
        """The share of the program's TEs computed inside grid kernels."""
        return self.grid_tes / self.tes if self.tes else 0.0

    def as_dict(self) -> dict:
        return {"launches": self.launches, "calls": self.calls, "grid_kernels": self.grid_kernels,
                "cooperative": self.cooperative, "grid_syncs": self.grid_syncs, "tes": self.tes,
                "grid_tes": self.grid_tes, "share": self.share, "fallbacks": [list(f) for f in self.fallbacks]}

    def line(self) -> str:
        """One line: what describe() and `souffle compile` print."""
        return (f"{self.launches} launches per inference, {self.grid_kernels} grid kernels ({self.cooperative} "
                f"cooperative), {self.grid_syncs} grid syncs, {self.grid_tes} of {self.tes} TEs "
                f"({self.share:.0%}) inside grid kernels, {len(self.fallbacks)} fallbacks")

    def fallback_lines(self) -> list[str]:
        return [f"fallback: {name}: {reason}" for name, reason in self.fallbacks]


def is_fallback(reason: str) -> bool:
    return any(mark in reason for mark in (FAILED, PROLOGUES, TILE))


def grid_figures(plan: ExecutionPlan) -> GridFigures:
    """The figures of a CUDA plan (every call counts as one launch where it records none)."""
    grid = [call for call in plan.calls if any(launch.grid for launch in call.launches)]
    return GridFigures(
        launches=plan.device_launches, calls=len(plan.calls), grid_kernels=len(grid),
        cooperative=sum(1 for call in grid if any(launch.cooperative for launch in call.launches)),
        grid_syncs=sum(l.grid_syncs * l.launches_per_call for call in plan.calls for l in call.launches),
        tes=sum(len(call.stages) for call in plan.calls), grid_tes=sum(len(call.stages) for call in grid),
        fallbacks=tuple((call.name, call.reason) for call in plan.calls if is_fallback(call.reason)))
