"""The two-level analysis of a whole TE program, as one immutable record the later passes query.

analyze() runs each level once per TE (linear in the program); queries that compose maps (chain_map,
dependence) run on demand, because only the transformations that need them know which paths matter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import islpy as isl
from tvm import te

from souffle_py.ir.analysis.body import reads
from souffle_py.ir.analysis.element_level import DATA_DEPENDENT, ONE_TO_MANY, Access, compose, te_accesses
from souffle_py.ir.analysis.naming import Names, name_program
from souffle_py.ir.analysis.reuse import SpatialReuse, TemporalReuse, find_reuse
from souffle_py.ir.analysis.tensor_level import LivePeak, TEStats, TensorInfo, live_peak, te_stats, tensor_infos
from souffle_py.ir.graph import placeholders
from souffle_py.ir.marks import state_of

if TYPE_CHECKING:
    from souffle_py.ir.program import TEProgram

ONE_RELIES_ON_ONE = "one-relies-on-one"
ONE_RELIES_ON_MANY = "one-relies-on-many"


@dataclass(frozen=True, eq=False)
class TEInfo(TEStats):
    """Everything known about one TE: its tensor-level stats plus one Access per input tensor.

    dependence: "data-dependent" if any access is, else "one-relies-on-many" if any access is one-to-many,
    else "one-relies-on-one" (every output element reads one element of each input).
    """

    accesses: tuple[Access, ...]
    dependence: str

    def access(self, tensor: str) -> Access:
        for access in self.accesses:
            if access.tensor == tensor:
                return access
        raise KeyError(f"TE '{self.name}' does not read '{tensor}' (it reads {[a.tensor for a in self.accesses]})")


def te_dependence(accesses: Sequence[Access]) -> str:
    kinds = {a.kind for a in accesses}
    if DATA_DEPENDENT in kinds:
        return DATA_DEPENDENT
    return ONE_RELIES_ON_MANY if ONE_TO_MANY in kinds else ONE_RELIES_ON_ONE


@dataclass(frozen=True, eq=False, repr=False)
class ProgramAnalysis:
    """tes and tensors are keyed by unique name in program order (placeholders first for tensors); `names`
    maps the program's te.Operation / tensor_key to those names."""

    tes: dict[str, TEInfo]
    tensors: dict[str, TensorInfo]
    spatial_reuse: tuple[SpatialReuse, ...]
    temporal_reuse: tuple[TemporalReuse, ...]
    peak: LivePeak
    names: Names
    # recurrences (souffle_py/ir/marks.py): state placeholder -> the tensor it carries from step t - 1
    back_edges: dict[str, str] = field(default_factory=dict)

    def te_of(self, op: te.Operation) -> TEInfo:
        return self.tes[self.names.ops[op]]

    def access(self, consumer: str, producer: str) -> isl.Map:
        """The map from elements of tensor `consumer` to the elements of tensor `producer` its TE reads."""
        info = self.tensors[consumer]
        if info.producer is None:
            raise ValueError(f"'{consumer}' is a placeholder: it reads nothing")
        access_map = self.tes[info.producer].access(producer).map
        return access_map.set_tuple_name(isl.dim_type.in_, consumer)  # a multi-output TE's k-th tensor

    def chain_map(self, path: Sequence[str]) -> isl.Map:
        """Compose along a producer chain of tensor names, consumer first: [Y, Z, X] gives Y -> X."""
        if len(path) < 2:
            raise ValueError("a chain needs at least a consumer and a producer")
        return compose(self.access(a, b) for a, b in zip(path, path[1:]))

    def dependence(self, consumer: str, producer: str) -> isl.Map:
        """Which elements of `producer` each element of `consumer` depends on, over every path between them:
        the union of the chain maps, built once per tensor in reverse program order (no path enumeration)."""
        if consumer == producer or producer not in self.tensors:
            raise ValueError(f"'{producer}' must be another tensor of the program")
        if self.back_edges:
            return self._dependence_through_recurrences(consumer, producer)
        order = list(self.tensors.values())
        reaches = {producer}  # tensors from which `producer` is reachable, by increasing definition
        for info in sorted(order, key=lambda t: t.live[0]):
            if info.producer is not None and any(a.tensor in reaches for a in self.tes[info.producer].accesses):
                reaches.add(info.name)
        if consumer not in reaches:
            raise ValueError(f"'{consumer}' does not depend on '{producer}'")
        found: dict[str, isl.Map] = {}
        for info in sorted(order, key=lambda t: -t.live[0]):
            if info.name == producer or info.name not in reaches or (info.name != consumer and info.name not in found):
                continue
            for access in self.tes[info.producer].accesses:
                if access.tensor not in reaches:
                    continue
                step = self.access(info.name, access.tensor)
                reached = step if info.name == consumer else found[info.name].apply_range(step)
                prior = found.get(access.tensor)
                found[access.tensor] = (reached if prior is None else prior.union(reached)).coalesce()
        return found[producer]

    def state_map(self, state: str) -> isl.Map:
        """state[t, ...] -> source[t - 1, ...] for t >= 1 (at t = 0 the state is the initial value)."""
        source = self.back_edges[state]
        shape = self.tensors[state].shape
        rest = [f"i{d}" for d in range(1, len(shape))]
        bounds = " and ".join([f"1 <= t < {shape[0]}", *(f"0 <= {v} < {n}" for v, n in zip(rest, shape[1:]))])
        return isl.Map(f"{{ {state}[{', '.join(['t', *rest])}] -> {source}[{', '.join(['t - 1', *rest])}] "
                       f": {bounds} }}")

    def _dependence_through_recurrences(self, consumer: str, producer: str) -> isl.Map:
        """With back edges the tensor graph has cycles: the union of every access map and state map,
        transitively closed by isl (exact for the shifts of a time loop), restricted to the pair."""
        edges = [self.state_map(state) for state in self.back_edges]
        for info in self.tensors.values():
            if info.producer is not None:
                edges += [self.access(info.name, a.tensor) for a in self.tes[info.producer].accesses]
        union = isl.UnionMap.from_map(edges[0])
        for edge in edges[1:]:
            union = union.union(isl.UnionMap.from_map(edge))
        closure, _exact = union.transitive_closure()
        maps: list[isl.Map] = []
        closure.foreach_map(maps.append)
        pairs = [m for m in maps if m.get_tuple_name(isl.dim_type.in_) == consumer
                 and m.get_tuple_name(isl.dim_type.out) == producer]
        if not pairs:
            raise ValueError(f"'{consumer}' does not depend on '{producer}'")
        return pairs[0].coalesce()


def analyze(program: TEProgram) -> ProgramAnalysis:
    """Both levels of analysis of a TEProgram (a pure function: the program is only read)."""
    stages = program.stages
    outputs = list(program.outputs.values())
    held = placeholders(outputs)
    names = name_program(held, stages)
    tes = {}
    for index, op in enumerate(stages):
        op_reads = reads(op)
        stats = te_stats(op, index, names, program.origins.get(op.name), op_reads)
        accesses = te_accesses(op, names, op_reads)
        tes[stats.name] = TEInfo(**vars(stats), accesses=accesses, dependence=te_dependence(accesses))
    tensors = tensor_infos(held, stages, outputs, names, program.placeholder_kind)
    spatial, temporal = find_reuse(tensors, list(tes))
    back_edges = {names.tensor(state_of(op)): names.tensor(op.output(0))
                  for op in stages if state_of(op) is not None}
    return ProgramAnalysis(tes=tes, tensors=tensors, spatial_reuse=tuple(spatial), temporal_reuse=tuple(temporal),
                           peak=live_peak(tensors, list(tes)), names=names, back_edges=back_edges)
