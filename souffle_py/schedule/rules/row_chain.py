"""The row chain rule: a softmax-like run of row reductions and their epilogue, scheduled one row at a time.

A softmax is three stages over the same rows: a max, a sum of exponentials, and the normalized output
(a LayerNorm: mean, variance, inverse deviation, output). Scheduled stage by stage, each stage streams the
whole tensor: over Whisper-tiny's 6 x 1500 x 1500 attention scores (54 MB, far beyond the caches) the three
passes took 10 ms per layer at ~18 GB/s. Here the row-level stages are computed under the epilogue's row
loop: the first reads each 6 KB row from memory and the others find it in L1, one pass in and one out, as
ONNX Runtime's softmax kernel does (Whisper-tiny's encoder 343 -> 322 ms on one thread). Only for chains
whose data exceeds ROW_CHAIN_MIN_BYTES: smaller ones (BERT's 12 x 128 x 128 scores, 786 KB; ViT's 12 x 197
x 197, 1.9 MB) stay in L2 between stages, and their epilogue keeps one flat vector run over all rows rather
than a scalar tail per row (197 = 12 vectors + 5: HF ViT-base 3% slower row by row).
"""

from __future__ import annotations

import logging
import math

from tvm import tirx

from souffle_py.cpu_target import CpuTarget
from souffle_py.failures import not_applied, rule_failed
from souffle_py.schedule.blocks import vector_lanes, block_kind, block_loops, leaf_blocks, loop_extent
from souffle_py.schedule.flat import contiguous_suffix, partitions_last, vectorize_run
from souffle_py.schedule.reductions import reduce_under
from souffle_py.schedule.rules.base import ChainRule
from souffle_py.schedule.thresholds import ROW_CHAIN_MIN_BYTES  # the epilogue's data: beyond a core's L2

log = logging.getLogger(__name__)



def schedule_row_chains(sch, names) -> set[str]:
    """Schedule every row chain among the blocks named `names`. The names of the blocks scheduled here: the
    default rules leave them alone. A chain a primitive refuses is left as it was."""
    scheduled: set[str] = set()
    wanted = set(names)
    # the search runs on a copy: its queries would enter the trace, which a stage's variant record replays
    # inside a merged kernel, where GetChildBlocks("root") finds other blocks and the replay fails
    probe = sch.copy()
    for block in reversed(leaf_blocks(probe)):
        name = probe.get(block).name_hint
        if name not in wanted or name in scheduled:
            continue
        try:
            members = row_chain(probe, block, wanted)
        except Exception as exc:  # noqa: BLE001  (a bug in the matcher: reported, the blocks left to their rules)
            rule_failed("row chain", name, exc, "the stage rules")
            continue
        if not members:
            continue
        trial = sch.copy()
        try:  # first on a copy: a primitive that refuses halfway would leave the blocks half-scheduled
            with partitions_last():
                _schedule(trial, trial.get_sblock(name), members)
        except Exception as exc:  # noqa: BLE001  (tvm.s_tir.ScheduleError)
            not_applied("row chain", name, exc, "the stage rules")
            continue
        _schedule(sch, sch.get_sblock(name), members)
        scheduled |= {name, *members}
        log.debug("%s computes %s row by row", name, ", ".join(members))
    return scheduled


def row_chain(sch, consumer, wanted) -> list[str]:
    """The row-level producers of the injective block `consumer` ([rows..., columns], contiguous along the
    columns): blocks over the rows alone, reductions over the columns or elementwise, reached from it
    through such blocks, each read only within the chain. Latest first; empty if there are none."""
    stmt = sch.get(consumer)
    if block_kind(sch, consumer) != "injective" or not isinstance(stmt.body, tirx.BufferStore):
        return []
    extents = [int(iv.dom.extent) for iv in stmt.iter_vars]
    if (len(extents) < 2 or len(block_loops(sch, consumer)) != len(extents) or extents[-1] < 2 * vector_lanes()
            or math.prod(extents) * 4 < ROW_CHAIN_MIN_BYTES or contiguous_suffix(stmt, list(stmt.iter_vars)) < 1):
        return []
    rows = [e for e in extents[:-1] if e > 1]
    members, frontier = {}, [consumer]
    while frontier:
        for producer in sch.get_producers(frontier.pop()):
            name = sch.get(producer).name_hint
            if name not in members and name in wanted and _over_rows(sch, producer, rows, extents[-1]):
                members[name] = producer
                frontier.append(producer)
    chain = {stmt.name_hint, *members}
    if not any(block_kind(sch, b) == "reduction" for b in members.values()) or any(
            sch.get(c).name_hint not in chain for b in members.values() for c in sch.get_consumers(b)):
        return []
    order = [sch.get(b).name_hint for b in leaf_blocks(sch)]
    return sorted(members, key=order.index, reverse=True)


def _over_rows(sch, block, rows, columns: int) -> bool:
    """Whether `block` runs over the rows alone: its spatial extents (units dropped) are `rows`, and it is
    either elementwise or one reduction over `columns` elements."""
    stmt = sch.get(block)
    spatial = [int(iv.dom.extent) for iv in stmt.iter_vars if int(iv.iter_type) == 0]
    reduce = [int(iv.dom.extent) for iv in stmt.iter_vars if int(iv.iter_type) == 2]
    if [e for e in spatial if e > 1] != rows or len(stmt.writes) != 1 or len(block_loops(sch, block)) != len(
            stmt.iter_vars):
        return False
    kind = block_kind(sch, block)
    return kind == "injective" and not reduce or kind == "reduction" and reduce == [columns]


def _schedule(sch, consumer, members) -> None:
    """The chain under the consumer's fused row loop (parallel), each reduction in vector lanes there, the
    consumer's columns in whole vectors and a tail."""
    *row_loops, columns = sch.get_loops(consumer)
    row = sch.fuse(*row_loops) if len(row_loops) > 1 else row_loops[0]
    if loop_extent(sch, row) > 1:
        sch.parallel(row)
    members_under(sch, members, row)
    vectorize_run(sch, consumer, columns)


def members_under(sch, members, row) -> None:
    """A chain's members (latest first: each one's readers are under the row already) computed under the
    loop `row`, each reduction in vector lanes there (its lanes split off first: rfactor needs its own
    loops)."""
    for name in members:
        block = sch.get_sblock(name)
        if block_kind(sch, block) == "reduction":
            reduce_under(sch, block, row)
        else:
            sch.compute_at(block, row)


class RowChain(ChainRule):
    """Each chain of row reductions and their epilogue over more than ROW_CHAIN_MIN_BYTES, row by row."""

    name = "row chain"

    def schedule(self, sch, names, target: CpuTarget) -> set[str]:
        return schedule_row_chains(sch, names)
