"""What a schedule rule is: a class that says whether it fits a block and schedules it, so that the default
schedule is an ordered list of rules (cpu.py) tried by one dispatcher (dispatch.py), as TVM dlight's rules
are tried by ApplyDefaultSchedule, and each rule can be tested alone on a small TensorIR function.
Most rules are BlockRules: the blocks of one kind or one pass's mark, scheduled by one function; the chain
rules (ChainRule) schedule several blocks together and run first.

`applies` reads the block (sch.get) and nothing else, so that a stage's trace records only what `apply`
does (the trace replays inside other kernels, staged.py). `apply` may still find part way that it does
not fit: it returns False (nothing changed) and the next rule that applies is tried, or raises
RuleDoesNotApply / a ScheduleError (the block keeps what was done; failures.py).
"""

from __future__ import annotations

from souffle_py.cpu_target import CpuTarget
from souffle_py.schedule.blocks import block_kind


class ScheduleRule:
    """One default schedule for one kind of block. `target`: the CpuTarget compiled for (the rules' sizes
    come from it, budgets.py and thresholds.py)."""

    name = "rule"

    def applies(self, sch, block, target: CpuTarget) -> bool:
        raise NotImplementedError

    def apply(self, sch, block, target: CpuTarget) -> bool | None:
        """Schedule `block`; False where it turned out not to fit and changed nothing (the next rule is
        tried), else None or True."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


class BlockRule(ScheduleRule):
    """A rule for the blocks of one kind (blocks.block_kind: 'gemm', 'conv', 'reduction', 'pad',
    'injective'), or those a pass marked (`mark`: a block annotation), or both; `schedule(sch, block)` does
    the work. Most rules are one of these."""

    kind: str | None = None
    mark: str | None = None

    def applies(self, sch, block, target: CpuTarget) -> bool:
        return ((self.mark is None or self.mark in sch.get(block).annotations)
                and (self.kind is None or block_kind(sch, block) == self.kind))

    def apply(self, sch, block, target: CpuTarget) -> bool | None:
        return type(self).schedule(sch, block)

    @staticmethod
    def schedule(sch, block) -> bool | None:
        raise NotImplementedError


class ChainRule:
    """A schedule of several blocks together (a softmax under its GEMM's row tiles, a row chain), tried
    before the block rules on the blocks that run threaded; the blocks it schedules are left out of them."""

    name = "chain rule"

    def schedule(self, sch, names, target: CpuTarget) -> set[str]:
        """Schedule every chain among the blocks named `names`; the names of the blocks scheduled."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"
