"""Rebuilding a TE program in topological order while reads of some tensors are redirected, and checking
each rebuilt TE against the analysis' maps.

Both transformations work this way: visiting the TEs producers first, a TE whose input was inlined,
combined or itself rebuilt gets a new body in which each such read is replaced (by the producer's body at
those indices, a slice of a combined TE, or the rebuilt tensor). Every rebuilt TE keeps the analysis' name
for what it replaces, so its isl access maps can be compared with the maps of the TE it replaces composed
with the relation each redirect stands for: that comparison is what makes a rewrite "checked".
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import islpy as isl
import numpy as np
from tvm import te

from souffle_py.ir.program import TEProgram
from souffle_py.ir.analysis import Access, ProgramAnalysis, bounded, maps_equal, te_accesses
from souffle_py.ir.analysis.naming import Names
from souffle_py.ir.exprs import simplify_indices
from souffle_py.ir.graph import compute_ops, map_loads, tensor_key

Redirect = Callable[[list], object]  # indices -> the expression that now reads that element


class Rebuild:
    """One topological rebuild of `program`: the redirect table, the analysis' names extended to new TEs,
    and access maps per TE (the analysis' for TEs it saw, computed once for new ones).

    `after(new_program)` starts the next rebuild sharing names and maps, so a pass can sweep twice without
    analysing again.
    """

    def __init__(self, program: TEProgram, analysis: ProgramAnalysis, names: Names | None = None,
                 maps: dict | None = None):
        self.program = program
        self.analysis = analysis
        self.names = names or Names(dict(analysis.names.ops), dict(analysis.names.tensors))
        self._maps: dict = {} if maps is None else maps
        self.redirects: dict[tuple, Redirect] = {}
        self.tensor_of: dict[tuple, te.Tensor] = {}  # old tensor key -> the tensor now computing it
        self._renamed: set[tuple] = set()  # redirects that only read a rebuilt tensor at the same indices
        self.params = dict(program.params)
        self.param_tensors = dict(program.param_tensors)
        self.origins = dict(program.origins)
        self._used = set(self.names.ops.values()) | set(self.names.tensors.values())

    def after(self, program: TEProgram) -> "Rebuild":
        return Rebuild(program, self.analysis, self.names, self._maps)

    # -- names and maps -------------------------------------------------------------------------------

    def name(self, op: te.Operation) -> str:
        return self.names.ops[op]

    def register(self, op: te.Operation, like: te.Operation | None = None) -> None:
        """Name a new TE or placeholder as the one it replaces (`like`), or by its own (unique) name."""
        base = self.names.ops[like] if like is not None else op.name
        self.names.ops[op] = base
        self._used.add(base)
        for i in range(op.num_outputs):
            self.names.tensors[(op, i)] = (self.names.tensors[(like, i)] if like is not None
                                           else base if op.num_outputs == 1 else f"{base}_{i}")

    def fresh_name(self, base: str) -> str:
        """A name no TE, tensor or placeholder of the program has (also a valid buffer name)."""
        name, n = base, 1
        while name in self._used:
            name, n = f"{base}_{n}", n + 1
        self._used.add(name)
        return name

    def accesses(self, op: te.ComputeOp) -> dict[str, Access]:
        """Input tensor name -> Access of a TE (cached)."""
        if op not in self._maps:
            if op in self.analysis.names.ops:
                found = self.analysis.te_of(op).accesses
            else:
                found = te_accesses(op, self.names)
            self._maps[op] = {a.tensor: a for a in found}
        return self._maps[op]

    def share_maps(self, old: te.ComputeOp, new: te.ComputeOp) -> None:
        """`new` reads what `old` read, only from rebuilt tensors of the same names: same access maps."""
        if not new.same_as(old):
            self._maps[new] = self.accesses(old)

    # -- rewriting --------------------------------------------------------------------------------------

    def rewrite(self, op: te.ComputeOp) -> te.ComputeOp:
        """`op` with its redirected reads replaced and indices simplified; `op` itself if none is."""
        if not any(tensor_key(t) in self.redirects for t in op.input_tensors):
            return op

        def redirect(tensor, indices):
            target = self.redirects.get(tensor_key(tensor))
            return None if target is None else target(indices)

        body = [map_loads(b, redirect) for b in op.body]
        if any(tensor_key(t) in self.redirects and tensor_key(t) not in self._renamed for t in op.input_tensors):
            iter_vars = list(op.axis) + list(op.reduce_axis)
            body = [simplify_indices(b, iter_vars) for b in body]
        new = te.ComputeOp(op.name, op.tag, op.attrs, op.axis, op.reduce_axis, body)
        self.register(new, like=op)
        return new

    def keep(self, old: te.ComputeOp, new: te.ComputeOp) -> None:
        """`new` computes what `old` did: readers of `old` read `new` (or `old` itself, when they are one)."""
        if new.same_as(old):
            for i in range(old.num_outputs):
                self.redirects.pop((old, i), None)
            return
        for i in range(old.num_outputs):
            tensor = new.output(i)
            self.tensor_of[(old, i)] = tensor
            self.redirects[(old, i)] = lambda indices, t=tensor: t(*indices)
            self._renamed.add((old, i))

    def add_param(self, base: str, value: np.ndarray) -> te.Tensor:
        """A new weight placeholder holding `value` (e.g. the stacked weights of combined TEs)."""
        name = self.fresh_name(base)
        tensor = te.placeholder(value.shape, str(value.dtype), name=name)
        self.register(tensor.op)
        self.params[name] = value
        self.param_tensors[name] = tensor
        return tensor

    def check(self, old: te.ComputeOp, new: te.ComputeOp, relations: Mapping[str, Sequence[isl.Map]]) -> list[str]:
        """Why `new`'s access maps differ from `old`'s composed with `relations`; empty when they agree.

        relations: old input tensor name -> maps from that tensor to tensors `new` reads (an inlined
        producer's own access maps, or a member's embedding into a combined TE); inputs not listed are
        read unchanged. Where an old map was inexact (an index the analysis could not express), the new map
        only has to contain the expected one: both are over-approximations.
        """
        old_maps, new_maps = self.accesses(old), self.accesses(new)
        expected: dict[str, isl.Map] = {}
        inexact: set[str] = set()
        for name, access in old_maps.items():
            for relation in relations.get(name, [None]):
                composed = access.map if relation is None else access.map.apply_range(relation)
                target = composed.get_tuple_name(isl.dim_type.out)
                expected[target] = composed if target not in expected else expected[target].union(composed)
                if not access.exact:
                    inexact.add(target)
        problems = []
        for target in sorted(set(expected) | set(new_maps)):
            if target not in expected or target not in new_maps:
                problems.append(f"reads of '{target}' appear or vanish")
                continue
            want, got = bounded(expected[target].coalesce, None), new_maps[target].map
            if want is not None and (maps_equal(got, want) or (target in inexact and bounded(
                    lambda: want.is_subset(got), False))):
                continue
            problems.append(f"access to '{target}' is {got}, the chained maps give {want}")
        return problems

    # -- the result -------------------------------------------------------------------------------------

    def finish(self) -> TEProgram:
        """The rebuilt program: outputs redirected, weights nobody reads any more dropped."""
        outputs = {name: self.tensor_of.get(tensor_key(t), t) for name, t in self.program.outputs.items()}
        stages = compute_ops(list(outputs.values()))
        read = {t.op for op in stages for t in op.input_tensors} | {t.op for t in outputs.values()}
        params = {n: v for n, v in self.params.items() if self.param_tensors[n].op in read}
        names = {op.name for op in stages}
        return self.program.replace(
            outputs=outputs, params=params, param_tensors={n: self.param_tensors[n] for n in params},
            origins={n: o for n, o in self.origins.items() if n in names})
