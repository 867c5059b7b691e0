"""Which model-input elements each output element depends on: the element-level maps of every TE composed
through the whole program (isl), from each output to each model input.

A rewrite of the program (a layout, a composition, a grouping, a precision change) may rename, reshape and
regroup every intermediate tensor, but never the set of input elements an output element is computed from.
This is the isl check of the pass manager (`check="isl"`): each pass's input and output programs must have
equal footprints wherever both are exact. A map that is not exact (a data-dependent index, an index isl
cannot express, a TE of several outputs) or that isl cannot settle within its operation budget is left
unchecked and counted, never guessed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import islpy as isl
from tvm import te

from souffle_py.ir.program import TEProgram
from souffle_py.ir.analysis.body import reads
from souffle_py.ir.analysis.element_level import DATA_DEPENDENT, bounded, maps_equal, te_accesses
from souffle_py.ir.analysis.naming import name_program


@dataclass(frozen=True)
class Footprint:
    """output element -> the elements of one model input it depends on; exact False where over-approximated."""

    map: isl.Map | None
    exact: bool


def input_footprints(program: TEProgram) -> dict[tuple[str, str], Footprint]:
    """(output name, input name) -> its Footprint, for every output that depends on that input."""
    stages = program.stages
    placeholders = list(program.inputs.values()) + [t for op in stages for t in op.input_tensors
                                                    if not isinstance(t.op, te.ComputeOp)]
    names = name_program(placeholders, stages)
    input_of = {names.tensor(t): f"in_{i}" for i, t in enumerate(program.inputs.values())}
    key_of = {f"in_{i}": name for i, name in enumerate(program.inputs)}
    of_op: dict = {}
    for op in stages:
        prints: dict[str, Footprint] = {}
        for access in te_accesses(op, names, reads(op)):
            exact = access.exact and access.kind != DATA_DEPENDENT
            if access.tensor in input_of:
                upstream = {input_of[access.tensor]: Footprint(
                    access.map.set_tuple_name(isl.dim_type.out, input_of[access.tensor]), True)}
                composed = {k: Footprint(access.map.set_tuple_name(isl.dim_type.out, k), exact)
                            for k in upstream}
            else:
                producer = next((t.op for t in op.input_tensors if names.tensor(t) == access.tensor), None)
                upstream = of_op.get(producer, {})
                exact = exact and producer is not None and producer.num_outputs == 1
                composed = {k: _composed(access.map, f, exact) for k, f in upstream.items()}
            for k, f in composed.items():
                prints[k] = f if k not in prints else _union(prints[k], f)
        of_op[op] = prints
    return {(out, key_of[k]): f for out, tensor in program.outputs.items()
            for k, f in of_op.get(tensor.op, {}).items()}


def _composed(access: isl.Map, upstream: Footprint, exact: bool) -> Footprint:
    if upstream.map is None:
        return Footprint(None, False)
    renamed = access.set_tuple_name(isl.dim_type.out, upstream.map.get_tuple_name(isl.dim_type.in_))
    result = bounded(lambda: renamed.apply_range(upstream.map).coalesce(), None)
    return Footprint(result, exact and upstream.exact and result is not None)


def _union(a: Footprint, b: Footprint) -> Footprint:
    if a.map is None or b.map is None:
        return Footprint(None, False)
    result = bounded(lambda: a.map.union(b.map).coalesce(), None)
    return Footprint(result, a.exact and b.exact and result is not None)


@dataclass(frozen=True)
class FootprintCheck:
    """Pairs compared and equal, pairs left unchecked (inexact or undecided), and the pairs that differ."""

    equal: int
    unchecked: int
    differ: tuple[str, ...]

    def summary(self) -> str:
        return (f"isl: {self.equal} output/input footprints equal, {self.unchecked} unchecked"
                + (f", differ: {', '.join(self.differ[:4])}" if self.differ else ""))


def compare_footprints(before: TEProgram, after: TEProgram) -> FootprintCheck:
    """Compare the footprints of two programs with the same inputs and outputs (a pass's input and output)."""
    old, new = input_footprints(before), input_footprints(after)
    equal = unchecked = 0
    differ = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if a is None or b is None:
            exact_side = a if b is None else b
            if exact_side.exact:  # an exact dependence appeared or vanished
                differ.append(f"{key[0]} <- {key[1]} ({'only before' if b is None else 'only after'})")
            else:
                unchecked += 1
        elif not (a.exact and b.exact):
            unchecked += 1
        else:
            same = _same(a.map, b.map)
            if same is None:
                unchecked += 1
            elif same:
                equal += 1
            else:
                differ.append(f"{key[0]} <- {key[1]}")
    return FootprintCheck(equal, unchecked, tuple(differ))


def _same(a: isl.Map, b: isl.Map) -> bool | None:
    a = a.set_tuple_name(isl.dim_type.in_, "out")
    b = b.set_tuple_name(isl.dim_type.in_, "out")
    if not a.get_space().is_equal(b.get_space()):
        return False
    undecided = object()
    result = bounded(functools.partial(a.is_equal, b), undecided)
    return None if result is undecided else bool(result)
