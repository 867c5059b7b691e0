"""Rows cut in uniform pieces: an elementwise block whose row selects among maps by comparing its index
with constants and reads them at index // c and index % c (the epilogue of horizontally stacked GEMMs:
out[i, j] = acc[j // 768, i, j % 768] * (scale_q if j < 768 else scale_k if j < 1536 else scale_v) + b[j])
is neither contiguous along the row nor free of lane-dependent conditions, so the injective rule left it
one scalar loop (BERT-base's int8 Q / K / V epilogue: 1.1 ms at 1.3 GFLOP/s). Split at the greatest common
divisor of those constants and the row, each piece reads contiguously and takes one branch: the piece is
vectorized, its conditions the same for all its lanes.
"""

from __future__ import annotations

import logging
import math

import tvm
import tvm_ffi
from tvm import tirx

from souffle_py.ir.exprs import substitute
from souffle_py.schedule.blocks import loop_extent, uses, vector_lanes
from souffle_py.schedule.flat import conditions_of, cut_points

log = logging.getLogger(__name__)


def uniform_piece(stmt, var, extent: int) -> int:
    """The piece g of the row `var` (extent `extent`): the gcd of the row and its constants, where that is a
    multiple of vector_lanes() shorter than the row and, with var = p g + u, every load and the store of
    `stmt` is contiguous in u (every if_then_else condition is then independent of u); 0 where there is
    none."""
    body = stmt.body
    if not isinstance(body, tirx.BufferStore) or extent % vector_lanes():
        return 0
    constants = _row_constants(body.value, var, extent)
    if constants is None:
        return 0
    g = math.gcd(extent, *constants) if constants else extent
    if g == extent or g % vector_lanes():
        return 0
    return g if _contiguous_pieces(stmt, var, g) else 0


def _row_constants(value, var, extent: int) -> list[int] | None:
    """The constants where the row's conditions change (flat.py's cut points: comparisons with constants)
    and those it is divided by (// and % in indices); None where a condition uses it otherwise."""
    cuts = cut_points(conditions_of(value), var, extent)
    if cuts is None:
        return None
    dividers = []
    tvm_ffi.structural_walk(value, [(t, lambda node: dividers.append(node.b.value) if uses(node.a, var)
                                      and isinstance(node.b, tirx.IntImm) else None)
                                     for t in (tirx.FloorDiv, tirx.FloorMod)])
    return [*cuts, *dividers]


def _contiguous_pieces(stmt, var, g: int) -> bool:
    """Whether, var = p g + u (u in [0, g)), every load and the store is base(p) + u or independent of u (the
    conditions are, g dividing their cut points)."""
    iv = next((iv for iv in stmt.iter_vars if iv.var.same_as(var)), None)
    if iv is None:
        return False
    p, u = tirx.Var("piece", "int32"), tirx.Var("lane", "int32")
    analyzer = tvm.sym.Analyzer()
    for other in stmt.iter_vars:
        analyzer.bind(other.var, tvm.ir.Range(other.dom.min, other.dom.min + other.dom.extent))
    analyzer.bind(p, tvm.ir.Range(0, int(iv.dom.extent) // g))
    analyzer.bind(u, tvm.ir.Range(0, g))
    split = {var.__chandle__(): p * g + u}
    body = stmt.body
    loads = []
    tvm_ffi.structural_walk(body.value, [(tvm.ir.expr.TensorLoad, loads.append)])
    accesses = [(load.indices, load.source.shape) for load in loads] + [(body.indices, body.buffer.shape)]
    for indices, shape in accesses:
        if not all(isinstance(d, tirx.IntImm) for d in shape):
            return False
        offset, stride = tirx.const(0, "int64"), 1
        for index, extent in reversed(list(zip(indices, shape))):
            offset = offset + tirx.Cast("int64", substitute(index, split)) * stride
            stride *= int(extent)
        rest = analyzer.simplify(offset - tirx.Cast("int64", u))
        if uses(rest, u) and uses(analyzer.simplify(offset), u):
            return False
    return True


def vectorize_pieces(sch, block, loops, time_axes: int, parallel_min: int) -> bool:
    """The innermost loop split in uniform pieces (module docstring), each piece in vectors, every other loop
    and the pieces fused into one parallel loop; False (nothing changed) where no piece fits."""
    stmt = sch.get(block)
    iter_vars = list(stmt.iter_vars)[time_axes:]
    if len(iter_vars) != len(loops) or not loops:
        return False
    extent = loop_extent(sch, loops[-1])
    g = uniform_piece(stmt, iter_vars[-1].var, extent)
    if not g:
        return False
    lanes = vector_lanes()
    total = math.prod(loop_extent(sch, loop) for loop in loops)
    piece, inner = sch.split(loops[-1], [None, g])
    vectors, lane = sch.split(inner, [None, lanes])
    outer = sch.fuse(*loops[:-1], piece, vectors)
    if total >= parallel_min:
        sch.parallel(outer)
    sch.vectorize(lane)
    log.debug("%s vectorized in pieces of %d of its row of %d", stmt.name_hint, g, extent)
    return True
