"""Element-level dependences (paper sec. 5.2) as isl maps: for each (TE, input tensor), which input elements
an output element reads. Vertical transformation composes the one-to-one maps; merging inserts grid syncs
where a stage is one-to-many on an earlier one.

A map { O[i..] -> I[...] } is built from the TE's index expressions: +, -, * by a constant, floordiv and
floormod by a positive constant, min and max are exact (quasi-affine); the conditions of if_then_else and
Select that are affine in the indices restrict each read to its piece. A reduction's variables become
existentially quantified, so { O[i, j] -> I[i, rk] : 0 <= rk < 64 } is the one-relies-on-many region. An
index that depends on tensor data (Gather) is never guessed: that dimension spans the input's extent and the
access is marked "data-dependent"; a data-independent index that is not quasi-affine is over-approximated the
same way and the access is marked inexact. Maps describe value dependences: a read under a Select branch
counts only where the branch is taken.

Quasi-affine single-valued maps also come as an integer matrix M and vector c, in the paper's convention:
M has one row per output dimension and one column per input dimension (M in Z^{n x m}), and output element v
(a row vector) reads input element v @ M + c -- for Figure 4's permute(strided_slice(relu)), M = [[0,1],[2,0]].
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import islpy as isl
import numpy as np
from tvm import te
from tvm.ir.prim import expr as pe

from souffle_py.ir.analysis.body import Guard, Read, contains_read, reads_by_tensor
from souffle_py.ir.analysis.naming import Names
from souffle_py.ir.analysis.tensor_level import shape_of

log = logging.getLogger(__name__)

CONTEXT = isl.DEFAULT_CONTEXT  # one context for every map, so maps of any two analyses compose
ISL_MAX_OPERATIONS = 100_000    # isl operations one comparison of maps may take (`bounded`): MobileViTv2's
                                # unfold / fold reshapes composed into maps whose equality isl did not
                                # settle in 10 minutes (the corpus's comparisons each take far fewer)

_RELATIONS = {pe.LT: "{a} < {b}", pe.LE: "{a} <= {b}", pe.GT: "{a} > {b}", pe.GE: "{a} >= {b}", pe.EQ: "{a} = {b}",
              pe.NE: "{a} < {b} or {a} > {b}"}

ONE_TO_ONE = "one-to-one"
ONE_TO_MANY = "one-to-many"
DATA_DEPENDENT = "data-dependent"


@dataclass(frozen=True, eq=False)
class Access:
    """How a TE reads one input tensor.

    map: output element -> the input elements it depends on (isl; its domain may be partial, e.g. the piece
         of a concatenation that comes from this input). text is the same map as a string.
    kind: ONE_TO_ONE (the map is single-valued), ONE_TO_MANY (it ranges over a reduction or another set),
          DATA_DEPENDENT (an index is read from tensor data).
    injective: no two output elements read the same input element (False for a broadcast).
    exact: False where an index could not be expressed and its dimension spans the whole extent.
    M, c: the affine form (see the module docstring) of a one-to-one map that has one, else None.
    """

    tensor: str
    kind: str
    map: isl.Map
    text: str
    single_valued: bool
    injective: bool
    exact: bool
    M: np.ndarray | None
    c: np.ndarray | None


@functools.lru_cache(maxsize=4096)
def _parse_set(text: str) -> isl.Set:
    """Parsed once per text: repeated layers and time steps produce the same domains and reads (islpy
    objects are immutable, so sharing them is safe)."""
    return isl.Set.read_from_str(CONTEXT, text)


@functools.lru_cache(maxsize=4096)
def _parse_map(text: str) -> isl.Map:
    return isl.Map.read_from_str(CONTEXT, text)


class _Space:
    """The iteration space of one TE: output dims i0.. then reduction dims r0.., named for isl."""

    def __init__(self, op: te.ComputeOp):
        axes = list(op.axis) + list(op.reduce_axis)
        self.dims = [f"i{k}" for k in range(len(op.axis))] + [f"r{k}" for k in range(len(op.reduce_axis))]
        self.n_out, self.n_reduce = len(op.axis), len(op.reduce_axis)
        self.var_names = {iv.var.__chandle__(): name for iv, name in zip(axes, self.dims)}
        bounds = [f"{int(iv.dom.min)} <= {name} < {int(iv.dom.min) + int(iv.dom.extent)}"
                  for iv, name in zip(axes, self.dims)]
        self.tuple = f"[{', '.join(self.dims)}]"
        self.domain = self.set(" and ".join(bounds) or "true")
        self._guards: dict[Guard, isl.Set] = {}

    def set(self, constraint: str) -> isl.Set:
        return _parse_set(f"{{ {self.tuple} : {constraint} }}")

    def affine(self, expr) -> str | None:
        """`expr` as an isl quasi-affine expression over the dims, or None when it is not one."""
        if isinstance(expr, pe.IntImm):
            return str(int(expr.value))
        if isinstance(expr, pe.Var):
            return self.var_names.get(expr.__chandle__())
        if isinstance(expr, pe.Cast):
            return self.affine(expr.value) if str(expr.ty).startswith(("int", "uint")) else None
        if not isinstance(expr, (pe.Add, pe.Sub, pe.Mul, pe.FloorDiv, pe.FloorMod, pe.Min, pe.Max)):
            return None
        a, b = self.affine(expr.a), self.affine(expr.b)
        if a is None or b is None:
            return None
        if isinstance(expr, pe.Add):
            return f"({a} + {b})"
        if isinstance(expr, pe.Sub):
            return f"({a} - {b})"
        if isinstance(expr, pe.Mul):
            constant = isinstance(expr.a, pe.IntImm) or isinstance(expr.b, pe.IntImm)
            return f"({a} * {b})" if constant else None
        if isinstance(expr, (pe.Min, pe.Max)):
            return f"{'min' if isinstance(expr, pe.Min) else 'max'}({a}, {b})"
        if not (isinstance(expr.b, pe.IntImm) and int(expr.b.value) > 0):
            return None
        return f"floor({a} / {b})" if isinstance(expr, pe.FloorDiv) else f"({a} mod {b})"

    def condition(self, cond) -> isl.Set | None:
        """The points where `cond` holds, or None when it is not an affine predicate of the indices."""
        if isinstance(cond, pe.IntImm):
            return self.domain if int(cond.value) else self.domain.subtract(self.domain)
        if isinstance(cond, (pe.And, pe.Or)):
            a, b = self.condition(cond.a), self.condition(cond.b)
            if a is None or b is None:
                return None
            return a.intersect(b) if isinstance(cond, pe.And) else a.union(b)
        if isinstance(cond, pe.Not):
            inner = self.condition(cond.a)
            return None if inner is None else self.domain.subtract(inner)
        if not isinstance(cond, tuple(_RELATIONS)):
            return None
        a, b = self.affine(cond.a), self.affine(cond.b)
        if a is None or b is None:
            return None
        return self.set(_RELATIONS[type(cond)].format(a=a, b=b))

    def guarded(self, guard: Guard | None) -> isl.Set:
        """The iteration points where a read under `guard` happens; a condition the analysis cannot express
        does not restrict the read (a sound over-approximation). Each guard is converted once."""
        if guard is None:
            return self.domain
        if guard not in self._guards:
            points = self.guarded(guard.parent)
            cond = self.condition(guard.cond)
            if cond is not None:
                points = points.intersect(cond if guard.holds else self.domain.subtract(cond)).coalesce()
            self._guards[guard] = points
        return self._guards[guard]

    def read_map(self, read: Read) -> tuple[isl.Map, bool, bool]:
        """(iteration point -> element read, exact, data-dependent) for one read."""
        target, constraints, exact, data = [], [], True, False
        for k, (index, extent) in enumerate(zip(read.indices, shape_of(read.tensor))):
            expr = self.affine(index)
            if expr is None:
                data = data or contains_read(index)
                exact = False
                expr = f"y{k}"
                constraints.append(f"0 <= y{k} < {extent}")
            target.append(expr)
        text = f"{{ {self.tuple} -> [{', '.join(target)}] : {' and '.join(constraints) or 'true'} }}"
        points = self.guarded(read.guard)
        return _parse_map(text).intersect_domain(points), exact, data


def affine_form(access_map: isl.Map) -> tuple[np.ndarray, np.ndarray] | None:
    """(M, c) with element v reading v @ M + c, for a single-valued map that is affine on its domain (every
    piece the same affine function, no integer divisions left once isl simplified it); else None. A dimension
    the domain fixes (extent 1) reads as a constant: its row of M is zero."""
    if access_map.is_empty() or not access_map.is_single_valued():
        return None
    pieces: list[isl.MultiAff] = []
    isl.PwMultiAff.from_map(access_map).foreach_piece(lambda _, ma: pieces.append(ma))
    if any(not ma.plain_is_equal(pieces[0]) for ma in pieces[1:]):
        return None
    n_in, n_out = access_map.dim(isl.dim_type.in_), access_map.dim(isl.dim_type.out)
    M, c = np.zeros((n_in, n_out), dtype=np.int64), np.zeros(n_out, dtype=np.int64)
    for k in range(n_out):
        aff = pieces[0].get_at(k)
        if aff.dim(isl.dim_type.div):
            return None
        values = [aff.get_coefficient_val(isl.dim_type.in_, j) for j in range(n_in)] + [aff.get_constant_val()]
        if not all(v.is_int() for v in values):
            return None
        M[:, k] = [v.to_python() for v in values[:-1]]
        c[k] = values[-1].to_python()
    return M, c


def te_accesses(op: te.ComputeOp, names: Names, op_reads: list[Read] | None = None) -> tuple[Access, ...]:
    """One Access per distinct input tensor of the TE, in op.input_tensors order (op_reads: body.reads(op),
    when the caller has it already)."""
    space = _Space(op)
    accesses = []
    for tensor_reads in reads_by_tensor(op, op_reads).values():
        maps = [space.read_map(read) for read in tensor_reads]
        access_map = functools.reduce(isl.Map.union, (m for m, _, _ in maps)).coalesce()
        access_map = access_map.project_out(isl.dim_type.in_, space.n_out, space.n_reduce)
        access_map = access_map.set_tuple_name(isl.dim_type.in_, names.ops[op])
        tensor_name = names.tensor(tensor_reads[0].tensor)
        access_map = access_map.set_tuple_name(isl.dim_type.out, tensor_name).coalesce()
        single = access_map.is_single_valued()
        data = any(d for _, _, d in maps)
        affine = affine_form(access_map) if single and not data else None
        accesses.append(Access(
            tensor=tensor_name, kind=DATA_DEPENDENT if data else ONE_TO_ONE if single else ONE_TO_MANY,
            map=access_map, text=str(access_map), single_valued=single, injective=access_map.is_injective(),
            exact=all(e for _, e, _ in maps), M=None if affine is None else affine[0],
            c=None if affine is None else affine[1]))
    return tuple(accesses)


def parse_map(text: str) -> isl.Map:
    """An isl map in the analysis' context (to compare with or compose onto the analysis' maps)."""
    return isl.Map.read_from_str(CONTEXT, text)


def compose(maps) -> isl.Map:
    """Maps along a producer chain, consumer first: compose([Y->Z, Z->X]) is Y->X (isl apply_range)."""
    maps = list(maps)
    result = maps[0]
    for nxt in maps[1:]:
        left, right = result.get_tuple_name(isl.dim_type.out), nxt.get_tuple_name(isl.dim_type.in_)
        if left != right:
            raise ValueError(f"cannot compose: the map into '{left}' is followed by a map from '{right}'")
        result = result.apply_range(nxt).coalesce()
    return result


def image(access_map: isl.Map, point) -> isl.Set:
    """The elements that element `point` (a sequence of ints) of the map's domain depends on."""
    name = access_map.get_tuple_name(isl.dim_type.in_)
    element = isl.Set.read_from_str(CONTEXT, f"{{ {name}[{', '.join(str(int(v)) for v in point)}] }}")
    return access_map.intersect_domain(element).range()


def maps_equal(a: isl.Map, b: isl.Map | str) -> bool:
    """Whether two maps relate exactly the same elements (tuple names included); False where isl cannot
    tell within ISL_MAX_OPERATIONS (`bounded`)."""
    b = parse_map(b) if isinstance(b, str) else b
    return bool(bounded(lambda: a.get_space().is_equal(b.get_space()) and a.is_equal(b), False))


def bounded(question, undecided):
    """`question()`, an isl computation, or `undecided` where it takes more than ISL_MAX_OPERATIONS isl
    operations: callers answer a comparison isl gives up on with their safe choice (keep a TE as it is)."""
    CONTEXT.set_max_operations(ISL_MAX_OPERATIONS)
    CONTEXT.reset_operations()
    try:
        return question()
    except isl.Error as exc:
        log.info("isl gave up after %d operations (%s): the safe choice is taken", ISL_MAX_OPERATIONS,
                 str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return undecided
    finally:
        CONTEXT.set_max_operations(0)
        CONTEXT.reset_operations()
