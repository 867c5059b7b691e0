"""The layer x time wavefront of stacked recurrences (the paper's LSTM, sections 4 and 7): one time loop
for all layers instead of one per layer.

Layer l + 1 at step t needs layer l's output at step t, and nothing later. Run layer l at wavefront step
w = t + l (a skew of l): at step w every layer reads only what the previous wavefront step wrote, so all
layers advance together under one time loop of T + L - 1 steps, and a grid-synchronized kernel separates
wavefront steps, not layers x steps, by its barriers (the paper's 10 x 100 LSTM: 109 steps instead of
1000 layer steps).

The rewrite is a TE-to-TE transformation:
- a *chain* is a sequence of recurrences (souffle_py/ir/marks.py) where recurrence b's only feed from
  other recurrences is recurrence a through *bridge* TEs (not members; e.g. the input projection
  x_proj = h_a @ W_b), all over the same T steps;
- every member and bridge X of the chain with skew s becomes a member of one new recurrence over the
  wavefront domain [T + L - 1, ...]: X'[w, ...] = X[w - s, ...] where layer (w - s) is active, else 0
  (a reduction's terms are guarded, so no inactive step reads outside its input);
- a read of another chain TE Y at step e becomes Y'[e + s_Y]: the same wavefront step (read in order
  after Y), or the previous step (a bridge reading the layer below, a plain read one step back); the
  state placeholders are re-made over the wavefront domain;
- TEs outside the chain that read it (the model's outputs) read Y'[e + s_Y].

Nothing is approximated: every active element is computed from the same values as before, so the
program's outputs are bit-identical. Chains that do not fit this form are left alone, with the reason
logged. The CPU keeps per-layer loops (its input projections are GEMMs over all steps, which beat T
per-step GEMVs there); the CUDA backend applies this in `restructure`, for its merged kernels.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import tvm
from tvm import te, tirx
from tvm.sym import Analyzer

from souffle_py.ir.program import TEProgram
from souffle_py.ir.exprs import substitute
from souffle_py.ir.graph import map_loads, rebuild_reading, tensor_key
from souffle_py.ir.marks import MEMBER, STATE, recurrences, state_of, without_marks
from te_passes.split_reduction import guarded

log = logging.getLogger(__name__)


class NotAWavefront(Exception):
    """Why a chain of recurrences keeps its per-layer time loops."""


@dataclass(frozen=True)
class Chain:
    """Recurrences (bottom layer first) with each chain TE's skew and the common number of steps."""

    recurrences: tuple[str, ...]
    skew: dict           # op -> skew (members and bridges)
    steps: int

    @property
    def name(self) -> str:
        return "wavefront(" + ", ".join(self.recurrences) + ")"


def wavefront(program: TEProgram) -> TEProgram:
    """`program` with each chain of two or more stacked recurrences run as one wavefront recurrence."""
    for chain in chains(program):
        try:
            program = _skewed(program, chain)
            log.info("%s: %d layers x %d steps in %d wavefront steps", chain.name, len(chain.recurrences),
                     chain.steps, chain.steps + len(chain.recurrences) - 1)
        except NotAWavefront as exc:
            log.info("%s keeps one time loop per layer: %s", chain.name, exc)
    return program


def chains(program: TEProgram) -> list[Chain]:
    """The chains of recurrences in `program` (pure analysis). A non-member TE that depends on exactly one
    recurrence a and feeds exactly one other recurrence b, through non-members only, is a bridge: b
    follows a. A chain is a path of follows; a recurrence that two others follow, or that follows two,
    ends the analysis for its chain (the skew would not be one per layer)."""
    stages = program.stages
    groups = recurrences(stages)
    if len(groups) < 2:
        return []
    owner = {op: name for name, ops in groups.items() for op in ops}
    sources: dict = {}   # non-member op -> recurrences it depends on through non-members
    for op in stages:
        if op not in owner:
            sources[op] = set().union(*({owner[t.op]} if t.op in owner else sources.get(t.op, set())
                                        for t in op.input_tensors))
    sinks: dict = {}     # non-member op -> recurrences it feeds through non-members
    for op in reversed(stages):
        for t in op.input_tensors:
            if t.op in sources:
                sinks.setdefault(t.op, set()).update({owner[op]} if op in owner else sinks.get(op, set()))
    follows: dict[str, set] = {}
    bridges: dict[str, list] = {}
    for op, found in sources.items():
        feeds = sinks.get(op, set())
        if len(found) == 1 and len(feeds) == 1 and found != feeds:
            (a,), (b,) = found, feeds
            follows.setdefault(b, set()).add(a)
            bridges.setdefault(b, []).append(op)
    below = {b: next(iter(a)) for b, a in follows.items() if len(a) == 1}
    above: dict[str, list] = {}
    for b, a in below.items():
        above.setdefault(a, []).append(b)
    found_chains = []
    for bottom in groups:
        if bottom in below or len(above.get(bottom, [])) != 1:
            continue
        layers = [bottom]
        while len(above.get(layers[-1], [])) == 1:
            layers.append(above[layers[-1]][0])
        skew = {}
        for level, name in enumerate(layers):
            skew.update({op: level for op in groups[name]})
            if level:
                skew.update({op: level for op in bridges[name]})
        extents = {int(op.output(0).shape[0]) if op.output(0).shape else 0 for op in skew}
        if len(extents) != 1:
            log.info("recurrences %s differ in their number of steps (%s): no wavefront", layers, sorted(extents))
            continue
        found_chains.append(Chain(tuple(layers), skew, extents.pop()))
    return found_chains


def _skewed(program: TEProgram, chain: Chain) -> TEProgram:
    """The program with `chain` rewritten over the wavefront domain (see the module docstring)."""
    steps, layers = chain.steps, len(chain.recurrences)
    span = steps + layers - 1
    states = {state_of(op).op: (op, s) for op, s in chain.skew.items() if state_of(op) is not None}
    new_states = {old: te.placeholder((span, *old.output(0).shape[1:]), old.output(0).dtype, name=f"{old.name}_wf")
                  for old in states}
    new_of: dict[tuple, te.Tensor] = {}
    for op in program.stages:
        if op in chain.skew:
            if op.num_outputs != 1:
                raise NotAWavefront(f"TE {op.name} has {op.num_outputs} outputs")
            new = _skewed_op(op, chain, span, new_of, states, new_states)
            new_of[tensor_key(op.output(0))] = new.output(0)
        else:
            rebuild_reading(op, {key: _reader(tensor, chain.skew.get(key[0])) for key, tensor in new_of.items()},
                            new_of)
    return program.rebuilt(new_of)


def _reader(tensor: te.Tensor, skew: int | None):
    """How a TE outside the chain reads a rebuilt tensor: one step later by its skew, or in place."""
    if not skew:
        return tensor
    return lambda *indices: tensor(indices[0] + skew, *indices[1:])


def _skewed_op(op, chain: Chain, span: int, new_of, states, new_states) -> te.ComputeOp:
    skew, steps = chain.skew[op], chain.steps
    analyzer = Analyzer()
    problems: list[str] = []

    def translate(w):
        def read(tensor, indices):
            if tensor.op in new_states:
                owner_skew = states[tensor.op][1]
                return new_states[tensor.op](analyzer.simplify(indices[0] + owner_skew), *indices[1:])
            if tensor.op not in chain.skew:
                return new_of[tensor_key(tensor)](*indices) if tensor_key(tensor) in new_of else None
            step = analyzer.simplify(indices[0] + chain.skew[tensor.op])
            back = analyzer.simplify(w - step)
            if not (isinstance(back, tvm.tirx.IntImm) and int(back) in (0, 1)):
                problems.append(f"TE {op.name} reads {tensor.op.name} at step {indices[0]}: neither this "
                                "wavefront step nor the previous one")  # raised outside TVM's callback
                return None
            return new_of[tensor_key(tensor)](step, *indices[1:])
        return read

    def compute(w, *rest):
        mapping = {op.axis[0].var.__chandle__(): w - skew,
                   **{iv.var.__chandle__(): r for iv, r in zip(op.axis[1:], rest)}}
        body = map_loads(substitute(op.body[0], mapping), translate(w))
        active = tirx.all(w >= skew, w < skew + steps) if skew else w < steps
        if isinstance(body, tirx.Reduce):  # its terms guarded too: no read of step -1 at w = 0
            return tirx.Reduce(body.combiner, [guarded(body, body.source[0], active)], body.axis,
                               body.condition, body.value_index, body.init)
        return tirx.if_then_else(active, body, tirx.const(0, str(op.output(0).dtype)))

    attrs = {**without_marks(op.attrs), MEMBER: chain.name}
    if state_of(op) is not None:
        attrs[STATE] = new_states[state_of(op).op]
    new = te.compute((span, *op.output(0).shape[1:]), compute, name=op.name, tag=op.tag, attrs=attrs).op
    if problems:
        raise NotAWavefront(problems[0])
    return new
