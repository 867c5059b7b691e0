"""Horizontal transformation (SOUFFLE sec. 6.1): independent TEs of the same kind become one TE.

Which TEs. Two TEs at the same level of the DAG (longest path from the inputs) never depend on each other,
so the TEs of one level whose bodies are the same computation up to the tensors they read (same operations,
same reduction domain, same rank) form a group: BERT's Q/K/V GEMMs and their bias adds, MMoE's experts and
gates, the layer-l-step-t cells of an unrolled LSTM (one level per wavefront: a wavefront's cell-state
updates become one TE, its hidden-state updates another, its GEMVs two).

How. The combined TE concatenates its members' outputs:
- members of equal shapes concatenate along an axis where their weights do (so the weights concatenate
  into one GEMM operand: Q/K/V become one (K, 3N) GEMM), else along an axis of extent 1 (a batch-1 GEMV's
  rows: the LSTM's input GEMVs over all steps become one GEMM), else along a new leading axis;
- members that differ in one axis concatenate along it, as in the paper's Figure 3 ((4,16) and (2,16)
  become (6,16)).
Each read of the template body is unified over the members: one read if every member reads the same
element (the shared input, read once), one read at an index affine in the member number if they read the
same tensor at evenly spaced places (e.g. slices of an earlier combined TE), one read of a new weight
concatenating or stacking the members' weights (built with numpy at compile time), otherwise a chain of
predicates choosing the member's own read (Figure 3's if_then_else). Reductions are split into parts that
need no predicate, which would cost a branch per multiply-add; members of different shapes stay one
predicated TE only while the reduction is small (PREDICATED_MACS). Readers of a member then read its
slice of the combined tensor through the embedding map -- no copy is added.

Checked with isl: the combined TE restricted to member k's region must read, through the embedding, exactly
what member k read (its maps composed with the weight embeddings), and every rebuilt reader's maps must
equal its old maps composed with the member embeddings.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import islpy as isl
import numpy as np
import tvm
import tvm_ffi
from tvm import te, tirx
from tvm.ir.prim import expr as pe

from souffle_py.ir.program import TEProgram
from souffle_py.ir.analysis import ProgramAnalysis, analyze, bounded, parse_map
from souffle_py.ir.analysis.body import contains_read, reads
from souffle_py.ir.exprs import simplify_indices, substitute
from souffle_py.ir.graph import map_loads, tensor_key
from te_passes.horizontal_layout import Layout, choose_layout, op_shape, position_of_axis_var
from te_passes.rebuild import Rebuild
from te_passes.weight_blocks import blocked_position, channels_of, reblocked, reblocking
from souffle_py.ir.marks import LAYOUT_COPY, member_of

log = logging.getLogger(__name__)

# A stacked weight that duplicates weights other TEs still read is built only when small (biases), or when
# the same stack serves several groups (an LSTM's weights, shared by every full wavefront).
SMALL_PARAM_BYTES = 1 << 16
# Members of different shapes whose reduction would read through predicates combine only up to this many
# multiply-adds in all: a predicated operand makes the reduction scalar (a branch per multiply-add), which
# costs more than the stages combining saves beyond a few microseconds of work. Above it they are split like
# equal shapes: Funnel's twelve relative-position projections (256/128/64 x 768 x 768 each) became one
# 2.3 GFLOP reduction choosing input and weight through eleven predicates (17.6 GFLOP/s, 133 ms), HRNet's
# fuse layers (strided 3x3 convs of 32/16/16 filters) one scalar conv (3.7 GFLOP/s).
PREDICATED_MACS = 1 << 16


@dataclass(frozen=True)
class Group:
    """One combined TE: its members (in member order), layout and how each read was unified."""

    name: str
    members: tuple[str, ...]
    layout: str  # "new axis 0" or "concat axis d"
    shared: tuple[str, ...] = ()  # tensors read once for all members
    stacked: tuple[str, ...] = ()  # new weights concatenating or stacking the members' weights
    predicated: int = 0  # reads chosen among members by predicates


@dataclass(frozen=True)
class HorizontalLog:
    tes_before: int
    tes_after: int
    groups: tuple[Group, ...] = ()
    refused: tuple[str, ...] = ()  # groups not combined and why (the isl check; never expected)
    kept_apart: tuple[str, ...] = ()  # groups this pass chose not to combine, and why (a cost)
    new_params: dict[str, int] = field(default_factory=dict)  # stacked weights: name -> bytes
    dropped_params: dict[str, int] = field(default_factory=dict)  # weights no longer read: name -> bytes

    def summary(self) -> str:
        members = sum(len(g.members) for g in self.groups)
        text = f"{members} TEs combined into {len(self.groups)} TEs"
        if self.groups:
            big = max(self.groups, key=lambda g: len(g.members))
            text += f" (largest: {big.name} <- {len(big.members)} TEs, {big.layout})"
        if self.new_params:
            text += (f"; {len(self.new_params)} stacked weights ({sum(self.new_params.values()) / 2**20:.1f} MiB, "
                     f"replacing {len(self.dropped_params)} weights of "
                     f"{sum(self.dropped_params.values()) / 2**20:.1f} MiB)")
        if self.refused:
            text += f"; {len(self.refused)} groups not combined (see refused)"
        return text


def horizontal(program: TEProgram, analysis: ProgramAnalysis | None = None) -> tuple[TEProgram, HorizontalLog]:
    """Combine independent same-kind TEs level by level; returns the new program and what was done."""
    analysis = analysis or analyze(program)
    stages = program.stages
    level = _levels(stages)
    groups = _plan(program, stages, level)
    state = Rebuild(program, analysis)
    builder = _Builder(state, program, analysis, groups)
    group_of = {op: g for g in groups for op in g}
    for op in sorted(stages, key=lambda o: level[o]):  # sorted() is stable: producers stay first
        group = group_of.get(op)
        if group is None:
            new = state.rewrite(op)
            builder.check_reader(op, new)
            state.keep(op, new)
        elif op.same_as(group[0]):
            builder.build(group)
    result = state.finish()
    for group in builder.done:
        log.debug("horizontal: %s (%s) <- %s", group.name, group.layout, ", ".join(group.members))
    for refusal in builder.refused:
        log.warning("horizontal: group not combined: %s", refusal)
    return result, HorizontalLog(tes_before=len(stages), tes_after=len(result.stages), groups=tuple(builder.done),
                                 refused=tuple(builder.refused), kept_apart=tuple(builder.kept_apart),
                                 new_params={n: result.params[n].nbytes for n in builder.new_params
                                             if n in result.params},
                                 dropped_params={n: v.nbytes for n, v in program.params.items()
                                                 if n not in result.params})


def _levels(stages) -> dict:
    """Longest path from the inputs: TEs of one level are pairwise independent."""
    level = {}
    for op in stages:
        level[op] = 1 + max((level[t.op] for t in op.input_tensors if t.op in level), default=-1)
    return level


# -- planning: which TEs form a group ---------------------------------------------------------------------

_CANONICAL: dict = {}


def _canonical_var(name: str, dtype: str):
    return _CANONICAL.setdefault((name, dtype), tvm.ir.Var(name, dtype))


def _kind(op: te.ComputeOp):
    """The body with axes, reduction variables and reads replaced by canonical variables: two TEs with
    structurally equal kinds compute the same thing from (possibly) different tensors."""
    mapping = {iv.var.__chandle__(): _canonical_var(f"c{k}", str(iv.var.ty)) for k, iv in enumerate(op.axis)}
    mapping.update({iv.var.__chandle__(): _canonical_var(f"r{k}", str(iv.var.ty))
                    for k, iv in enumerate(op.reduce_axis)})
    count = [0]

    def slot(tensor, _):
        count[0] += 1
        return _canonical_var(f"s{count[0] - 1}", str(tensor.dtype))

    return substitute(map_loads(op.body[0], slot), mapping)


def _candidate(op: te.ComputeOp, outputs: set) -> bool:
    """Single-output TEs that are not program outputs and read no index from data. A copy into an
    instruction's operand layout (LAYOUT_COPY: vpdpbusd's input quads) stays its own: two such copies of
    different maps stacked read through predicates, scalar (ResNet-50 int8's stage-1 pixel quads: 0.29 ms
    against 0.02 apart)."""
    if op.num_outputs != 1 or (op, 0) in outputs or member_of(op) is not None or LAYOUT_COPY in (op.attrs or {}):
        return False
    return not any(contains_read(i) for read in reads(op) for i in read.indices)


def _plan(program: TEProgram, stages, level) -> list[list[te.ComputeOp]]:
    """Groups of >= 2 same-kind TEs per level, members ordered by the weights they read (then program
    order) so that groups over the same weights stack them the same way."""
    outputs = {tensor_key(t) for t in program.outputs.values()}
    buckets: dict = {}
    for op in stages:
        if not _candidate(op, outputs):
            continue
        kind = _kind(op)
        key = (level[op], tvm_ffi.structural_hash(kind), len(op.axis), str(op.output(0).dtype))
        for bucket in buckets.setdefault(key, []):
            if tvm_ffi.structural_equal(bucket[0][1], kind):
                bucket.append((op, kind))
                break
        else:
            buckets[key].append([(op, kind)])
    params = {t.op for t in program.param_tensors.values()}
    position = {op: i for i, op in enumerate(stages)}
    groups = []
    for bucket_list in buckets.values():
        for bucket in bucket_list:
            for members in _by_shape(bucket):
                if len(members) >= 2:
                    members.sort(key=lambda op: (tuple(t.op.name for t in op.input_tensors if t.op in params),
                                                 position[op]))
                    groups.append(members)
    return groups


def _by_shape(bucket) -> list[list[te.ComputeOp]]:
    """One group if the shapes agree or differ in a single axis the body uses only in indices; else one
    group per shape."""
    shapes = [op_shape(op) for op, _ in bucket]
    differing = [d for d in range(len(shapes[0])) if len({s[d] for s in shapes}) > 1]
    if not differing:
        return [[op for op, _ in bucket]]
    if len(differing) == 1:
        axis = _canonical_var(f"c{differing[0]}", str(bucket[0][0].axis[differing[0]].var.ty))
        uses = []
        tvm_ffi.structural_walk(bucket[0][1], [(tvm.ir.Var, lambda v: uses.append(v.same_as(axis)))])
        if not any(uses):
            return [[op for op, _ in bucket]]
    by_shape: dict = {}
    for op, _ in bucket:
        by_shape.setdefault(op_shape(op), []).append(op)
    return list(by_shape.values())


# -- building one combined TE -----------------------------------------------------------------------------

class _Builder:
    """Builds the combined TE of each group inside one Rebuild and records what it did."""

    def __init__(self, state: Rebuild, program: TEProgram, analysis: ProgramAnalysis, groups):
        self.state = state
        self.program = program
        self.analysis = analysis
        self.params = {t.op: name for name, t in program.param_tensors.items()}
        self.stacks: list = []  # (param names, how, the new weight), in creation order
        self.signatures: dict = {}
        self.plan_of = {op: g for g in groups for op in g}
        for g in groups:
            signature = self._signature(g)
            self.signatures[signature] = self.signatures.get(signature, 0) + 1
        self.relations: dict[str, list] = {}  # member name -> [its embedding map into the combined TE]
        self.done: list[Group] = []
        self.refused: list[str] = []
        self.kept_apart: list[str] = []
        self.new_params: list[str] = []

    def _signature(self, group) -> tuple:
        return tuple(tuple(self.params[t.op] for t in op.input_tensors if t.op in self.params) for op in group)

    def check_reader(self, old: te.ComputeOp, new: te.ComputeOp) -> None:
        """A rebuilt reader must read exactly its old elements through the members' embeddings."""
        if new.same_as(old):
            return
        relations = {name: rel for name in self.state.accesses(old) if (rel := self.relations.get(name))}
        if not relations:
            return self.state.share_maps(old, new)
        problems = self.state.check(old, new, relations)
        if problems:
            raise AssertionError(f"horizontal: rebuilding '{old.name}' changed what it reads: {problems[0]}")

    def build(self, group: list[te.ComputeOp]) -> None:
        rewritten = [self.state.rewrite(op) for op in group]
        for op, new in zip(group, rewritten):
            self.check_reader(op, new)
        for part in self._parts(group, rewritten):
            if len(part) == 1:
                self.state.keep(group[part[0]], rewritten[part[0]])
            else:
                self._combine([group[k] for k in part], [rewritten[k] for k in part])

    def _parts(self, group, rewritten) -> list[list[int]]:
        """Members split (greedily, in member order) into parts whose reads all unify without predicates,
        when the members reduce: a predicated read in a reduction's source is evaluated per multiply-add,
        and the combined TE is no GEMM or conv any rule takes. Members without reduction stay one part, and
        so do members of different shapes (Figure 3) whose combined reduction is small enough
        (PREDICATED_MACS) for the stages it saves to outweigh a predicate per multiply-add."""
        shapes = {op_shape(op) for op in rewritten}
        if not rewritten[0].reduce_axis or (len(shapes) > 1 and _multiply_adds(rewritten) <= PREDICATED_MACS):
            return [list(range(len(group)))]
        parts: list[list[int]] = []
        for k in range(len(group)):
            for part in parts:
                if self._unifies([group[j] for j in part + [k]], [rewritten[j] for j in part + [k]]):
                    part.append(k)
                    break
            else:
                parts.append([k])
        if len(shapes) > 1 and len(parts) > 1:
            self._kept_apart(group, f"split into {len(parts)} parts: combined, the reduction would choose its "
                             "operands by a predicate per multiply-add")
        return parts

    def _unifies(self, group, rewritten) -> bool:
        layout = choose_layout(rewritten, self.params)
        slots = [self._slots(op, layout.local(k, op), rewritten[0]) for k, op in enumerate(rewritten)]
        if len({len(s) for s in slots}) != 1:
            return False
        record = Group(name="", members=(), layout="")
        return all(self._unify(list(column), layout, group, record, dry=True)[2].predicated == 0
                   for column in zip(*slots))

    def _combine(self, group, rewritten) -> None:
        state = self.state
        layout = choose_layout(rewritten, self.params)
        slots = [self._slots(op, layout.local(k, op), rewritten[0]) for k, op in enumerate(rewritten)]
        if len({len(s) for s in slots}) != 1:
            return self._keep(group, rewritten, "members read different numbers of tensors")
        name = state.fresh_name(f"{group[0].name}_h{len(group)}")
        record = Group(name=name, members=tuple(op.name for op in group),
                       layout=("new axis 0" if layout.new_axis else f"concat axis {layout.axis}"))
        values, embeddings = [], {}
        for column in zip(*slots):
            value, embedding, record = self._unify(list(column), layout, group, record)
            values.append(value)
            embeddings.update(embedding)
        template = map_loads(rewritten[0].body[0], _Counter(values))
        template = substitute(template, layout.local(0, rewritten[0]))
        body = simplify_indices(template, list(layout.iter_vars) + list(rewritten[0].reduce_axis))
        first = rewritten[0]
        combined = te.ComputeOp(name, first.tag, first.attrs, layout.iter_vars, first.reduce_axis, [body])
        state.register(combined)
        state.origins[name] = ", ".join(dict.fromkeys(self.program.origins.get(op.name, op.name) for op in group))
        problems = self._check_combined(combined, group, rewritten, layout, embeddings)
        if problems:
            return self._keep(group, rewritten, problems[0])
        output = combined.output(0)
        for k, op in enumerate(group):
            state.redirects[(op, 0)] = lambda indices, k=k: output(*layout.embed(k, indices))
            embed = parse_map(layout.isl_region(name, k, state.name(op))).reverse()
            self.relations[state.name(op)] = [embed]
        self.done.append(record)

    def _keep(self, group, rewritten, reason: str) -> None:
        """Leave the group's members apart: a combination the dependence check refused (a warning, and in
        the log's `refused`)."""
        self.refused.append(f"{', '.join(op.name for op in group)}: {reason}")
        for op, new in zip(group, rewritten):
            self.state.keep(op, new)

    def _kept_apart(self, group, reason: str) -> None:
        """A choice of this pass not to combine (logged as such, in the log's `kept_apart`)."""
        line = f"{', '.join(op.name for op in group)}: {reason}"
        log.info("horizontal: kept apart: %s", line)
        self.kept_apart.append(line)

    def _slots(self, op, local: dict, first) -> list:
        """(tensor, indices in combined coordinates) per read, in body order; the member's reduction
        variables are renamed to the first member's, which the combined TE keeps."""
        mapping = dict(local)
        mapping.update({iv.var.__chandle__(): first_iv.var for iv, first_iv in zip(op.reduce_axis, first.reduce_axis)})
        found = []

        def visit(tensor, indices):
            found.append((tensor, [substitute(i, mapping) for i in indices], indices))
            return None

        map_loads(op.body[0], visit)
        return found

    def _unify(self, column, layout: Layout, group, record: Group, dry: bool = False):
        """One expression for a read every member makes (its own tensor and indices), plus the embedding of
        each member's tensor into what the expression reads (for the isl check)."""
        analyzer = _analyzer(layout.iter_vars + list(group[0].reduce_axis))
        tensors = [t for t, _, _ in column]
        indices = [[analyzer.simplify(i) for i in idx] for _, idx, _ in column]
        same_tensor = len({tensor_key(t) for t in tensors}) == 1
        name = self.state.name(tensors[0].op)
        if same_tensor and all(_equal(idx, indices[0]) for idx in indices):
            record = _add(record, shared=name)
            return tensors[0](*indices[0]), {}, record
        if same_tensor and layout.member is not None:
            steps = _steps(indices, analyzer)
            if steps is not None:
                return tensors[0](*[i + layout.member * s for i, s in zip(indices[0], steps)]), {}, record
        if all(t.op in self.params for t in tensors) and len({tensor_key(t) for t in tensors}) == len(tensors):
            unified = self._stack(column, indices, layout, group, record, dry)
            if unified is not None:
                return unified
        value = tensors[-1](*indices[-1])
        for k in range(len(column) - 2, -1, -1):
            value = tirx.if_then_else(layout.region(k), tensors[k](*indices[k]), value)
        return value, {}, _add(record, predicated=1)

    def _stack(self, column, indices, layout: Layout, group, record: Group, dry: bool):
        """Members' distinct weights as one weight: concatenated along the position indexed by the
        concatenation axis, or stacked on a new leading axis indexed by the member number. A contiguous run
        of a weight stacked earlier is reused (the LSTM's ramp-down wavefronts read part of the full one)."""
        tensors = [t for t, _, _ in column]
        values = [self.program.params[self.params[t.op]] for t in tensors]
        position = None
        if not layout.new_axis:
            positions = {position_of_axis_var(orig, op.axis[layout.axis].var)
                         for (_, _, orig), op in zip(column, group)}
            if len(positions) == 1 and None not in positions:
                position = positions.pop()
        others = [[i for p, i in enumerate(idx) if p != position] for idx in indices]
        if not all(_equal(o, others[0]) for o in others):
            position = None
        rest = [v.shape[:position] + v.shape[position + 1:] for v in values] if position is not None else []
        reblock = None
        if position is None and not layout.new_axis:  # weights blocked by channel (a conv's): re-blocked
            found = [blocked_position(orig, op.axis[layout.axis].var, v.shape)
                     for (_, _, orig), op, v in zip(column, group, values)]
            reblock = reblocking(found, indices, values, layout.extents)
        if position is not None and len(set(rest)) == 1 and [v.shape[position] for v in values] == layout.extents:
            how = ("concat", position)
        elif reblock is not None:
            how = ("reblock", *reblock)
        elif layout.member is not None and len({v.shape for v in values}) == 1 and all(
                _equal(idx, indices[0]) for idx in indices):
            how, position = ("stack",), None
        else:
            return None
        names = tuple(self.params[t.op] for t in tensors)
        found = self._stacked_run(names, how)
        if found is None and not self._may_stack(names, group, values):
            return None
        if dry:
            return None, {}, record
        if found is None:
            if how[0] == "reblock":
                value = reblocked(values, *how[1:])
            else:
                value = np.concatenate(values, axis=position) if how[0] == "concat" else np.stack(values)
            weight = self.state.add_param(f"{names[0]}_h{len(names)}", np.ascontiguousarray(value))
            self.stacks.append((names, how, weight))
            self.new_params.append(weight.op.name)
            found = (weight, 0)
        weight, first = found
        weight_name = self.state.name(weight.op)
        embeddings = {}
        offset = first * how[2] if how[0] == "reblock" else first
        for k, (t, v) in enumerate(zip(tensors, values)):
            dims = [f"x{j}" for j in range(v.ndim)]
            bounds = " and ".join(f"0 <= {d} < {s}" for d, s in zip(dims, v.shape)) or "true"
            if how[0] == "concat":
                target = list(dims)
                target[position] = f"{dims[position]} + {offset}"
                offset += v.shape[position]
            elif how[0] == "reblock":
                (at, block), own = how[1:], v.shape[-1]
                channel = f"({dims[at]} * {own} + {dims[-1]} + {offset})"
                target = list(dims)
                target[at], target[-1] = f"floor({channel} / {block})", f"{channel} mod {block}"
                offset += v.shape[at] * own
            else:
                target = [str(first + k)] + dims
            embeddings[(k, self.state.name(t.op))] = parse_map(
                f"{{ {self.state.name(t.op)}[{', '.join(dims)}] -> {weight_name}[{', '.join(target)}] : {bounds} }}")
        if how[0] == "concat":
            read = list(indices[0])
            read[position] = layout.iter_vars[layout.axis].var + first
        elif how[0] == "reblock":
            (at, block), channel = how[1:], layout.iter_vars[layout.axis].var + first * how[2]
            read = list(indices[0])
            read[at], read[-1] = tirx.floordiv(channel, block), tirx.floormod(channel, block)
        else:
            read = [layout.member + first, *indices[0]]
        return weight(*read), embeddings, _add(record, stacked=weight_name)

    def _stacked_run(self, names, how):
        """(weight, offset) of an earlier stacked weight holding `names` contiguously, in order; else None.
        The offset is along the concatenated position (concat) or the leading axis (stack)."""
        for stacked, stacked_how, weight in self.stacks:
            if stacked_how != how:
                continue
            for start in range(len(stacked) - len(names) + 1):
                if stacked[start:start + len(names)] == names:
                    if how[0] == "stack":
                        return weight, start
                    if how[0] == "reblock":  # only a run that starts at a block boundary reads as one
                        channels = sum(channels_of(self.program.params[n], how[1]) for n in stacked[:start])
                        if channels % how[2]:
                            continue
                        return weight, channels // how[2]
                    return weight, sum(self.program.params[n].shape[how[1]] for n in stacked[:start])
        return None

    def _may_stack(self, names, group, values) -> bool:
        """A new weight must not duplicate big weights other TEs keep reading, unless groups share it."""
        members = {self.state.name(op) for op in group}
        private = all(set(self.analysis.tensors[self.state.name(self.program.param_tensors[n].op)].readers) <= members
                      for n in names)
        small = sum(v.nbytes for v in values) <= SMALL_PARAM_BYTES
        return private or small or self.signatures.get(self._signature(self.plan_of[group[0]]), 0) >= 2

    def _check_combined(self, combined, group, rewritten, layout: Layout, embeddings) -> list[str]:
        """Member k's region of the combined TE must read what member k read, through the embeddings."""
        state = self.state
        name = state.name(combined)
        expected: dict[str, isl.Map] = {}
        for k, (op, new) in enumerate(zip(group, rewritten)):
            region = parse_map(layout.isl_region(name, k, state.name(op)))
            for tensor, access in state.accesses(new).items():
                composed = region.apply_range(access.map)
                embedding = embeddings.get((k, tensor))
                if embedding is not None:
                    composed = composed.apply_range(embedding)
                target = composed.get_tuple_name(isl.dim_type.out)
                expected[target] = composed if target not in expected else expected[target].union(composed)
        got = state.accesses(combined)
        problems = []
        for target in sorted(set(expected) | set(got)):
            if target not in expected or target not in got:
                problems.append(f"reads of '{target}' appear or vanish")
            elif not bounded(lambda: got[target].map.is_equal(expected[target].coalesce()), False):
                problems.append(f"access to '{target}' is {got[target].map}, the members read {expected[target]}")
        return problems


class _Counter:
    """map_loads callback replacing the i-th read (in body order) with values[i]."""

    def __init__(self, values):
        self.values = values
        self.i = 0

    def __call__(self, tensor, indices):
        value = self.values[self.i]
        self.i += 1
        return value


def _analyzer(iter_vars):
    analyzer = tvm.sym.Analyzer()
    for iv in iter_vars:
        analyzer.bind(iv.var, iv.dom)
    return analyzer


def _equal(a, b) -> bool:
    return len(a) == len(b) and all(tvm_ffi.structural_equal(x, y) for x, y in zip(a, b))


def _steps(indices, analyzer) -> list[int] | None:
    """Constant c with indices[k] == indices[0] + k * c at every position, or None."""
    steps = []
    for p in range(len(indices[0])):
        delta = analyzer.simplify(indices[1][p] - indices[0][p]) if len(indices) > 1 else tirx.const(0, "int32")
        if not isinstance(delta, pe.IntImm):
            return None
        step = int(delta.value)
        for k, idx in enumerate(indices):
            if not _is_zero(analyzer.simplify(idx[p] - indices[0][p] - k * step)):
                return None
        steps.append(step)
    return steps


def _multiply_adds(ops) -> int:
    """The members' reduction work: output elements times reduction extent, summed."""
    return sum(int(np.prod(op_shape(op))) * int(np.prod([int(r.dom.extent) for r in op.reduce_axis])) for op in ops)


def _is_zero(expr) -> bool:
    return isinstance(expr, pe.IntImm) and int(expr.value) == 0


def _add(record: Group, shared: str | None = None, stacked: str | None = None, predicated: int = 0) -> Group:
    return dataclasses.replace(
        record,
        shared=record.shared + ((shared,) if shared and shared not in record.shared else ()),
        stacked=record.stacked + ((stacked,) if stacked and stacked not in record.stacked else ()),
        predicated=record.predicated + predicated)
