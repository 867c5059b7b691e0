"""Vertical transformation (SOUFFLE sec. 6.2): collapse chains of one-relies-on-one TEs into one TE.

A one-relies-on-one TE P reads each input at M v + c (a quasi-affine map). Inlining P into a reader C --
substituting C's index expressions for P's axis variables in P's body -- gives C the composed access
M_P (M_C v + c_C) + c_P to P's inputs, which is equation (2) of the paper; repeated along a chain it
collapses the chain into its last TE. Every inlining is checked with isl: the rebuilt reader's access map to
each tensor must equal the reader's old map to P composed with P's map to that tensor, or the inlining is
refused (and logged).

Candidates are the TEs the paper calls one-relies-on-one: no reduction axis, one output, and (so that isl
can check the composition exactly) no index computed from data. A TE reading one input at several fixed
places (an LSTM cell reading four gate slices; the analysis calls that one-to-many) qualifies: each piece
composes the same way. Program outputs stay, since something must store them.

Two sweeps, producers first:
1. data movement (cost 0: reshape, transpose, slice, squeeze, broadcast, cast) is inlined into every
   reader, so a GEMM reads its operands through the composed indices (the Reshape/Transpose around
   attention disappear into the batch matmuls);
2. the remaining one-relies-on-one TEs are inlined where recomputation stays within RECOMPUTE_BUDGET.
   Because sweep 2 visits producers first, a TE reaching its turn already holds the chain above it, so an
   elementwise epilogue (bias add, GELU, scaling) becomes one TE reading the GEMM's result one-to-one --
   the form the scheduler inlines into the GEMM's write-back (a TE reduction must stay at the top of its
   body, so the epilogue cannot live in the GEMM's TE itself).

Recomputation. Inlining P evaluates its body once per read: f = sum over readers of (reader's iteration
points x distinct indices it reads P at) / P's points. P is inlined when (f - 1) x cost(P) <= budget,
cost from souffle_py.ir.exprs.cost: data movement 0, cheap arithmetic 1, intrinsic calls (exp, erf, tanh,
sigmoid, sqrt, pow) and divisions 8. So a bias add is recomputed by a few readers but never per
multiply-add of a GEMM operand (f = N), and an exp, GELU or sigmoid feeding two readers stays materialized.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import tvm
from tvm import te

from souffle_py.failures import rule_failed
from souffle_py.ir.program import TEProgram
from souffle_py.ir.analysis import DATA_DEPENDENT, ProgramAnalysis, analyze
from souffle_py.ir.exprs import cost, is_pad_value, points, read_sites, substitute
from souffle_py.ir.graph import tensor_key
from te_passes.rebuild import Rebuild
from souffle_py.ir.marks import LAYOUT_COPY, member_of
from te_passes.int8_conv_vnni import PIXEL_LANES

log = logging.getLogger(__name__)

# Extra operations per element of an inlined TE accepted for not storing and reloading it. Below EXPENSIVE_OP
# (8), so an intrinsic call or a division is never evaluated twice, while a few cheap operations are (a bias
# add read by five TEs, a two-operation residual read by three): cheaper than the store and reload of an
# fp32 element (8 bytes, ~50 flops at this CPU's ridge point of ~7 flop/byte) that inlining removes.
RECOMPUTE_BUDGET = 4


@dataclass(frozen=True)
class VerticalLog:
    """What the pass did: TE counts, producers inlined, chains composed (surviving TE -> the TEs inlined
    into it, transitively), why candidates stayed (reason -> count) and isl refusals (never expected)."""

    tes_before: int
    tes_after: int
    inlined: int
    chains: dict[str, tuple[str, ...]] = field(default_factory=dict)
    kept: dict[str, int] = field(default_factory=dict)
    isl_refusals: tuple[str, ...] = ()

    def summary(self) -> str:
        longest = max(self.chains.items(), key=lambda kv: len(kv[1]), default=None)
        text = (f"{self.inlined} TEs inlined into {len(self.chains)} composed TEs"
                + (f" (longest: {longest[0]} <- {len(longest[1])} TEs)" if longest else ""))
        if self.kept:
            text += "; kept: " + ", ".join(f"{n} {reason}" for reason, n in sorted(self.kept.items()))
        if self.isl_refusals:
            text += f"; {len(self.isl_refusals)} refused by the isl check"
        return text


def vertical(program: TEProgram, analysis: ProgramAnalysis | None = None,
             budget: float = RECOMPUTE_BUDGET) -> tuple[TEProgram, VerticalLog]:
    """Compose chains of one-relies-on-one TEs; returns the new program and what was done."""
    analysis = analysis or analyze(program)
    state = Rebuild(program, analysis)
    record = _Record()
    moved = _sweep(state, lambda c, f: c == 0, record, count_kept=False)
    composed = _sweep(state.after(moved), lambda c, f: c == 0 or (f() - 1) * c <= budget, record, count_kept=True)
    before, after = len(program.stages), composed.stages
    surviving = {op.name for op in after}
    chains = {k: tuple(v) for k, v in record.chains.items() if k in surviving}
    for name, absorbed in chains.items():
        log.debug("vertical: %s <- %s", name, ", ".join(absorbed))
    for refusal in record.isl_refusals:
        log.warning("vertical: isl refused %s", refusal)
    return composed, VerticalLog(tes_before=before, tes_after=len(after), inlined=before - len(after),
                                 chains=chains, kept=dict(record.kept), isl_refusals=tuple(record.isl_refusals))


class _Record:
    def __init__(self):
        self.chains: dict[str, list[str]] = {}
        self.kept: dict[str, int] = {}
        self.isl_refusals: list[str] = []


def _sweep(state: Rebuild, sweep_cost, record: _Record, count_kept: bool) -> TEProgram:
    """One producers-first pass inlining the candidates `sweep_cost(cost, f)` accepts (f: a callable,
    evaluated only when the decision needs it)."""
    program = state.program
    outputs = {tensor_key(t) for t in program.outputs.values()}
    consumers = program.consumers()
    order = {op: i for i, op in enumerate(program.stages)}
    sites: dict = {}
    inlined: dict[tuple, te.ComputeOp] = {}  # old tensor key -> the composite body to substitute
    for op in program.stages:
        try:
            new = _rewrite_checked(state, op, inlined, record)
        except Exception as exc:  # noqa: BLE001  (a body the rewrite cannot handle: its producers stay materialized)
            rule_failed("vertical", op.name, exc, "its producers materialized")
            record.kept["not rewritable"] = record.kept.get("not rewritable", 0) + 1
            _materialize(state, op, inlined)
            state.keep(op, state.rewrite(op))
            continue
        reason = "program output" if (op, 0) in outputs else _not_candidate(state, op, new)
        c = cost(new.body[0]) if reason is None else 0
        if reason is None and c > 0 and any(LAYOUT_COPY in (r.attrs or {}) for r in consumers.get(op, [])):
            reason = "read by a layout copy"  # the copy stays a plain transpose (marks.LAYOUT_COPY)
        if reason is None and c > 0 and _pixel_conv_epilogue_before_a_pad(op, new, consumers.get(op, [])):
            reason = "a pixel conv's epilogue read by a pad"
        if reason is None and c > 0 and _first_of_two_conv_epilogues(op, new, consumers, order):
            reason = "a pixel conv's epilogue added to a later conv's"
        if reason is None:
            if sweep_cost(c, lambda: _recompute(op, consumers[op], sites)):
                inlined[(op, 0)] = new
                state.redirects[(op, 0)] = _inline(new)
                continue
            reason = "recompute over budget"
        if count_kept and reason != "a reduction":  # reductions are never candidates: no counter
            record.kept[reason] = record.kept.get(reason, 0) + 1
        state.keep(op, new)
    return state.finish()


def _recompute(op: te.ComputeOp, readers, sites: dict) -> float:
    """f: how many times inlining evaluates each element of `op` (readers' points x distinct read sites)."""
    for reader in readers:
        if reader not in sites:
            sites[reader] = read_sites(reader)
    return sum(points(r) * sites[r][(op, 0)] for r in readers) / points(op)


def _rewrite_checked(state: Rebuild, op: te.ComputeOp, inlined: dict, record: _Record) -> te.ComputeOp:
    """`op` with inlined producers substituted, if isl confirms each composed map; producers whose
    composition it refuses are read from their (materialized) composite TE instead."""
    new = state.rewrite(op)
    used = [key[0] for key in dict.fromkeys(tensor_key(t) for t in op.input_tensors) if key in inlined]
    if not used:
        state.share_maps(op, new)
        return new
    relations = {state.name(p): [a.map for a in state.accesses(inlined[(p, 0)]).values()] for p in used}
    problems = state.check(op, new, relations)
    if not problems:
        absorbed = record.chains.setdefault(op.name, [])
        for p in used:
            absorbed += [n for n in [p.name, *record.chains.get(p.name, [])] if n not in absorbed]
        return new
    for p in used:  # materialize: readers from now on read the composite, which stays in the program
        composite = inlined.pop((p, 0))
        state.keep(p, composite)
        record.isl_refusals.append(f"{p.name} -> {op.name}: {problems[0]}")
    new = state.rewrite(op)
    state.share_maps(op, new)
    return new


def _materialize(state: Rebuild, op: te.ComputeOp, inlined: dict) -> None:
    """Keep the composites of the producers `op` reads as TEs of their own instead of inlining them."""
    for key in dict.fromkeys(tensor_key(t) for t in op.input_tensors):
        if key in inlined:
            state.keep(key[0], inlined.pop(key))


def _pixel_conv_epilogue_before_a_pad(old: te.ComputeOp, new: te.ComputeOp, readers) -> bool:
    """Whether `old` is the elementwise epilogue (a requantization) of an int8 conv with its lanes over
    pixels (te_passes/int8_conv_vnni.py) and only pads read it: kept a TE of its own, the conv computes it
    in its write-back of whole vectors (an int8 map, not int32) and the pad is a plain copy. Inlined into
    the pad, it was a pass over the int32 sums of its own (ResNet-50: 19 such pads, ~0.6 ms). A padded
    sum's reader is laid over its padded pixels first (te_passes/int8_pixel_epilogue.py)."""
    if not readers or not all(_elementwise(r) and is_pad_value(r.body[0]) for r in readers):
        return False
    return _reads_pixel_sum(old, new)


def _first_of_two_conv_epilogues(old: te.ComputeOp, new: te.ComputeOp, consumers: dict, order: dict) -> bool:
    """Whether `old` is a pixel conv's elementwise epilogue (a requantization) whose chain of one-input
    readers (its DequantizeLinear) ends in an elementwise TE that also reads the epilogue of a pixel conv
    computed after it: ResNet's first block of a stage adds its last conv and its downsampling conv. Kept a
    TE, the first conv writes the int8 map in its write-back and the later conv computes the sum in its own;
    inlined, the first conv wrote its int32 sums (ResNet-50's stage 0: 3.2 MB, four times the int8 map)
    for the later write-back to read."""
    if not _reads_pixel_sum(old, new):
        return False
    chain, reader = {old}, old
    while True:
        readers = consumers.get(reader, [])
        if len(readers) != 1 or not _elementwise(readers[0]):
            return False
        reader = readers[0]
        if len({tensor_key(t) for t in reader.input_tensors}) > 1:
            break
        chain.add(reader)
    for t in reader.input_tensors:
        source = t.op
        while source not in chain and _elementwise(source):
            if _reads_pixel_sum(source, source):
                if order.get(source, -1) > order[old]:
                    return True
                break
            if len(source.input_tensors) != 1:
                break
            source = source.input_tensors[0].op
    return False


def _elementwise(op) -> bool:
    return isinstance(op, te.ComputeOp) and not op.reduce_axis and len(op.body) == 1


def _reads_pixel_sum(old: te.ComputeOp, new: te.ComputeOp) -> bool:
    """Whether the TE (before and after its producers were composed into it) reads a pixel conv's int32 sum,
    directly or through its reshape to the NCHW map."""
    sources = {tensor_key(t): t for t in (*old.input_tensors, *new.input_tensors)}.values()
    return any(PIXEL_LANES in (t.op.attrs or {}) or (
        isinstance(t.op, te.ComputeOp) and not t.op.reduce_axis and len(t.op.input_tensors) == 1
        and PIXEL_LANES in (t.op.input_tensors[0].op.attrs or {})) for t in sources)


def _not_candidate(state: Rebuild, old: te.ComputeOp, new: te.ComputeOp) -> str | None:
    """Why `new` (rebuilt from `old`) cannot be inlined into its readers at all, or None. Inlining exact,
    data-independent producers keeps a TE's maps exact and data-independent, so `old`'s maps decide."""
    if isinstance(new.body[0], tvm.tirx.Reduce):
        return "a reduction"
    if new.num_outputs != 1:
        return "multiple outputs"
    if member_of(new) is not None:
        return "a recurrence step (its time loop carries state)"
    if LAYOUT_COPY in (new.attrs or {}):
        return "a layout copy"
    if any(a.kind == DATA_DEPENDENT or not a.exact for a in state.accesses(old).values()):
        return "data-dependent index"
    return None


def _inline(composite: te.ComputeOp):
    """Indices -> the composite's body evaluated at them (its axis variables substituted)."""
    body = composite.body[0]
    handles = [iv.var.__chandle__() for iv in composite.axis]
    return lambda indices: substitute(body, dict(zip(handles, indices)))
