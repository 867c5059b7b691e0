"""The row chain rule: a large softmax or LayerNorm chain computed row by row under its epilogue's row loop
(row_chains.py)."""

from __future__ import annotations

from souffle_py.cpu_target import CpuTarget
from souffle_py.schedule.row_chains import schedule_row_chains
from souffle_py.schedule.rules.base import ChainRule


class RowChain(ChainRule):
    """Each chain of row reductions and their epilogue over more than ROW_CHAIN_MIN_BYTES, row by row."""

    name = "row chain"

    def schedule(self, sch, names, target: CpuTarget) -> set[str]:
        return schedule_row_chains(sch, names)
