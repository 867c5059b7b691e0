"""One dispatcher for the default schedule rules: the chain rules over the threaded blocks, then each
remaining block's first rule that applies (cpu.py's order), under the failure policy of failures.py (a
rule that raises leaves the block as far as it got, with a warning naming the rule and the block; strict
mode raises); then the layout copies marked for their writers' tiles move there (rules/layout_copy.py)."""

from __future__ import annotations

from souffle_py.cpu_target import CpuTarget
from souffle_py.failures import not_applied
from souffle_py.schedule.blocks import block_named
from souffle_py.schedule.epilogue import TILE_EPILOGUE
from souffle_py.schedule.flat import partitions_last
from souffle_py.schedule.rules.base import ScheduleRule
from souffle_py.schedule.rules.cpu import CPU_CHAIN_RULES, CPU_RULES
from souffle_py.schedule.rules.layout_copy import IN_WRITER_TILE, LayoutCopy, move_into_writer_tiles
from souffle_py.schedule.threads import OneThread


def apply_rules(sch, names, on_one_thread, rules=CPU_RULES, chains=CPU_CHAIN_RULES) -> None:
    """Each block named in `names` scheduled by its rule, through OneThread where `on_one_thread(name)`;
    loop partitions last (flat.py)."""
    target = CpuTarget.current()
    with partitions_last():
        names = list(names)
        threaded = [n for n in names if not on_one_thread(n)]
        chained: set[str] = set()
        in_tiles: list = []
        for chain in chains:
            chained |= chain.schedule(sch, [n for n in threaded if n not in chained], target)
        for name in (n for n in names if n not in chained):
            block = block_named(sch, name)
            if block is None:  # inlined into an earlier block's schedule (a conv's epilogue)
                continue
            stmt = sch.get(block)
            if TILE_EPILOGUE in stmt.annotations:  # computed in a write-back when finished (epilogue.py)
                continue
            if any(int(iv.dom.extent) == 0 for iv in stmt.iter_vars):  # an empty tensor: nothing runs
                continue
            rule = apply_first(OneThread(sch) if on_one_thread(name) else sch, block, target, rules)
            if isinstance(rule, LayoutCopy):  # looked up again: transform_block_layout made the block anew
                block = sch.get_sblock(name)
                if IN_WRITER_TILE in sch.get(block).annotations:
                    in_tiles.append(block)
        move_into_writer_tiles(sch, in_tiles)  # none: no query recorded in the trace (a stage's replays)


def apply_first(sch, block, target: CpuTarget, rules=CPU_RULES) -> ScheduleRule | None:
    """Apply the first of `rules` that applies to `block` and accepts it (apply does not return False);
    the rule applied, or None. A rule that raises ends the search: every primitive preserves semantics,
    so a rule that stops halfway leaves a valid, slower schedule."""
    name = sch.get(block).name_hint
    for rule in rules:
        if not rule.applies(sch, block, target):
            continue
        try:
            if rule.apply(sch, block, target) is not False:
                return rule
        except Exception as exc:  # noqa: BLE001  (the failure policy: failures.py)
            not_applied(f"the default {rule.name} rule", name, exc, "its loops as the rule left them")
            return rule
    return None

