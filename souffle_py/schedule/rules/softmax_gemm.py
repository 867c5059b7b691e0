"""The softmax-GEMM chain rule: attention's softmax computed under its context GEMM's row tiles (CPU), so the
probabilities never reach memory. The first chain rule: the blocks it takes are left out of the row chains.

Over long sequences the attention probabilities P = softmax(Q.K^T) are far beyond the caches (Whisper-tiny's
6 x 1500 x 1500 per layer: 54 MB), and P.V read them back from memory after the softmax wrote them: the
softmax row chain (row_chain.py) ran at this host's memory bandwidth (54 MB in and 54 MB out, 7.4 ms per
layer), and P.V streamed them in again. As a fused attention kernel does (OpenVINO's SDPA), here the context
GEMM's rows are tiled, and for each tile of T rows the softmax chain (max, sum of exponentials,
normalization) runs under that tile's loop: its T x N probabilities stay in L1/L2, the GEMM reads them at
once, and only the scores are read from memory. The GEMM's register tile is the T rows by one or two
vectors of the value columns. Only for chains row_chain.py would schedule row by row (more than
ROW_CHAIN_MIN_BYTES), whose probabilities only the GEMM reads; any primitive that refuses leaves the blocks
to the other rules.
"""

from __future__ import annotations

import logging

from souffle_py.cpu_target import CpuTarget
from souffle_py.failures import RuleDoesNotApply, not_applied, rule_failed
from souffle_py.schedule.blocks import (
    block_kind, block_loops, leaf_blocks, loop_extent, operand_loads, vector_lanes, vector_registers,
)
from souffle_py.schedule.flat import partitions_last, vectorize_run
from souffle_py.schedule.rules.base import ChainRule
from souffle_py.schedule.rules.row_chain import members_under, row_chain

log = logging.getLogger(__name__)

MIN_ROWS = 4       # fewer rows per tile: no tile (the row chains and the GEMM rule schedule them apart)


def schedule_softmax_gemms(sch, names) -> set[str]:
    """Schedule each GEMM among the blocks named `names` whose operand is a large softmax chain's output,
    with the chain under its row tiles (module docstring). The names of the blocks scheduled here."""
    scheduled: set[str] = set()
    wanted = set(names)
    probe = sch.copy()  # the search's queries stay out of the schedule's trace (row_chain.py)
    for block in leaf_blocks(probe):
        name = probe.get(block).name_hint
        if name not in wanted or name in scheduled or block_kind(probe, block) != "gemm":
            continue
        try:
            found = _softmax_operand(probe, block, wanted)
        except Exception as exc:  # noqa: BLE001  (a bug in the matcher: reported, the GEMM left to the other rules)
            rule_failed("softmax GEMM", name, exc, "the row chains and the GEMM rule")
            continue
        if found is None:
            continue
        probs, members = found
        trial = sch.copy()
        try:  # first on a copy: a primitive that refuses halfway would leave the blocks half-scheduled
            with partitions_last():
                _schedule(trial, trial.get_sblock(name), probs, members)
        except Exception as exc:  # noqa: BLE001  (tvm.s_tir.ScheduleError, or no row tile)
            not_applied("softmax GEMM", name, exc, "the row chains and the GEMM rule")
            continue
        _schedule(sch, sch.get_sblock(name), probs, members)
        scheduled |= {name, probs, *members}
        log.debug("%s computes the softmax %s under its row tiles", name, probs)
    return scheduled


def _softmax_operand(sch, gemm, wanted):
    """(probabilities block name, its chain's members) where the GEMM reduces over the last axis of a row
    chain's output (its k-th column of row i: P[.., i, k]) that only it reads; else None."""
    stmt = sch.get(gemm)
    k, extent = next((iv.var, int(iv.dom.extent)) for iv in stmt.iter_vars if int(iv.iter_type) == 2)
    product = stmt.body.value.b
    for producer in sch.get_producers(gemm):
        name = sch.get(producer).name_hint
        if name not in wanted or block_kind(sch, producer) != "injective" or len(sch.get_consumers(producer)) != 1:
            continue
        buffer = sch.get(producer).writes[0].source
        reads = [ld for operand in (product.a, product.b) for ld in operand_loads(operand) if ld.source.same_as(buffer)]
        if len(reads) != 1 or not reads[0].indices[-1].same_as(k) or int(buffer.shape[-1]) != extent:
            continue
        members = row_chain(sch, producer, wanted)
        if members:
            return name, members
    return None


def _schedule(sch, gemm, probs: str, members) -> None:
    """The GEMM's rows in tiles of T (parallel with its batch axes), each tile's accumulators T rows by a
    vector tile of columns over the whole reduction; the chain computed under the tile loop, latest first."""
    *outer, i, j, k = block_loops(sch, gemm)
    rows, columns = loop_extent(sch, i), loop_extent(sch, j)
    tile, lanes = row_tile(rows, columns)
    io, ii = sch.split(i, [None, tile])
    jo, ji = sch.split(j, [None, lanes])
    row = sch.fuse(*outer, io) if outer else io
    sch.reorder(row, jo, k, ii, ji)
    acc = sch.cache_write(gemm, 0, "local")
    sch.reverse_compute_at(acc, jo)
    sch.parallel(row)
    sch.vectorize(ji)
    sch.vectorize(block_loops(sch, acc)[-1])
    sch.unroll(ii)
    sch.decompose_reduction(gemm, k)
    probabilities = sch.get_sblock(probs)
    sch.compute_at(probabilities, row)
    # the chain row by row inside the tile, as row_chain.py runs it (over the tile's rows at once, the row
    # axis took the vector lanes)
    members_under(sch, members, sch.get_loops(probabilities)[-2])
    vectorize_run(sch, probabilities, sch.get_loops(probabilities)[-1])


def row_tile(rows: int, columns: int) -> tuple[int, int]:
    """(rows, lanes) of the GEMM's register tile: the most FMAs per load (each step broadcasts a probability
    per row and loads a value vector per vector) within all vector registers but 4 of partial sums (the
    value vectors and the broadcast probability take the others: 28 of 32), rows a divisor of `rows`
    (no ragged tile: the chain's region would be) and lanes one or two vectors dividing `columns`. Whisper's
    1500 x 64: 12 x 32 (24 FMAs for 14 loads, where 25 x 16 has 25 for 26); PiT's 962 x 32: 13 x 32."""
    best, vector, accumulators = (0.0, 0, 0), vector_lanes(), vector_registers() - 4
    for lanes in (2 * vector, vector):
        vectors = lanes // vector
        tile = next((t for t in range(accumulators // vectors, MIN_ROWS - 1, -1) if rows % t == 0), 0)
        if columns % lanes == 0 and tile:
            best = max(best, (tile * vectors / (tile + vectors), lanes, tile))
    if not best[0]:
        raise RuleDoesNotApply(f"no register tile for {rows} rows of {columns} columns")
    return best[2], best[1]


class SoftmaxGemmChain(ChainRule):
    """Each GEMM whose operand is a large softmax chain's output, the chain under its row tiles."""

    name = "softmax GEMM"

    def schedule(self, sch, names, target: CpuTarget) -> set[str]:
        return schedule_softmax_gemms(sch, names)
