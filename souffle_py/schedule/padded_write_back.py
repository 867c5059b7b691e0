"""A pad's inside stored by the write-back that computes the padded map (a function-level pass).

Why: a conv reads its input through a padded copy, a pad stage of its own (often carrying the previous
conv's bias and activation): the producer writes the map, the pad reads it back and writes it again inside
a border of zeros, a pass of memory traffic only (MobileNetV2's 112 x 112 x 96 expand output: 0.19 ms of
3.1). ONNX Runtime's MLAS pads inside its conv kernel instead. Here the block that stores the map (a conv's
tile write-back, while the tile is in registers) stores the pad's value at the shifted point, the map is
gone, and the pad's nest stores only its border.
"""

from __future__ import annotations

import logging
import math

import tvm
import tvm_ffi
from tvm import s_tir, tirx

from souffle_py.schedule.blocks import vector_lanes, calls_function, uses
from souffle_py.schedule.epilogue import (blocks_in, disturbed_between, loads_of, moved_region, root_nests,
                                         unit_zeros, with_root_nests)
from souffle_py.ir.analysis.tensor_level import itemsize
from souffle_py.ir.exprs import substitute
from souffle_py.schedule.thresholds import MIN_PADDED_BYTES

log = logging.getLogger(__name__)

PADS_IN_WRITE_BACKS = True  # (off: each pad a pass of its own, as before)
# only pads of at least MIN_PADDED_BYTES (thresholds.py): a smaller map stays in the caches of the cores that
# wrote it, and its pad, parallel as the conv that reads it is, wrote it where that conv reads it; stored by
# the producer's tiles, the conv read half of it from the other core


def store_pads_in_write_backs(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` (scheduled) with each pad of an intermediate map computed where that map is stored: the
    producer's block stores the pad's value (`_pad_of`) at the shifted point instead of the map, and the
    pad's nest is replaced by nests over its border. Where the map has other readers, the producer stores
    both. A pad whose producer is not a plain store of each point, or whose maps are touched between the two
    nests, stays as it is."""
    if not PADS_IN_WRITE_BACKS or (found := root_nests(func)) is None:
        return func
    nests, alloc = found
    blocks = [blocks_in(nest) for nest in nests]
    changed = False

    def writers(buffer) -> list:
        return [(i, b) for i, found in enumerate(blocks) for b in found
                if any(region.source.same_as(buffer) for region in b.writes)]
    for r in range(len(nests)):
        if len(blocks[r]) != 1 or len(blocks[r][0].writes) != 1:
            continue
        # the pad's source: the intermediate map it reads that is computed last, the others before it
        maps = sorted((max((i for i, _ in writers(region.source)), default=-1), n)
                      for n, region in enumerate(blocks[r][0].reads)
                      if any(b.same_as(region.source) for b in alloc))
        if not maps or maps[-1][0] < 0 or len(writers(blocks[r][0].reads[maps[-1][1]].source)) != 1 \
                or maps[-1][0] >= r or any(i >= maps[-1][0] for i, _ in maps[:-1]):
            continue
        source = blocks[r][0].reads[maps[-1][1]].source
        output = blocks[r][0].writes[0].source
        if _bytes(output) < MIN_PADDED_BYTES or (pad := _pad_of(blocks[r][0], source)) is None \
                or len(writers(output)) != 1:
            continue
        # the map stays where another block reads it too (a residual block's output, its shortcut)
        shared = any(region.source.same_as(source) for found in blocks for b in found if not b.same_as(blocks[r][0])
                     for region in b.reads)
        w, producer = writers(source)[0]
        stored = _stored_by(producer, blocks[w + 1:r], blocks[r][0], pad, shared)
        if stored is None:
            log.debug("pad %s stays apart: its map's producer %s cannot store it", blocks[r][0].name_hint,
                      producer.name_hint)
            continue
        nests[w] = tvm_ffi.structural_map(nests[w], [(s_tir.stmt.SBlock, lambda b: stored if b.same_as(producer)
                                                        else b)])
        blocks[w] = blocks_in(nests[w])
        nests[r] = _border(blocks[r][0], pad)
        blocks[r] = blocks_in(nests[r])
        alloc = alloc if shared else [b for b in alloc if not b.same_as(source)]
        changed = True
    return with_root_nests(func, nests, alloc) if changed else func


def _pad_of(block, source) -> dict | None:
    """The pad of `source` that `block` is, else None: it stores each point of its map once (its iteration
    variables its indices) `if_then_else(inside, f(source[shifted]), constant)`, reading `source` only at
    the point shifted by a constant per axis, where `inside` is exactly the test that the shifted point
    lies in `source`, and f calls no function (epilogue.py measured SiLU in a conv's write-back slower):
    {source, shifts (per source axis), axes (the pad's axis of each source axis), value (f), constant,
    borders (pad axis -> (first, end) of the inside, for the axes the test cuts)}."""
    store = block.body
    if not isinstance(store, tirx.BufferStore) or block.init is not None:
        return None
    call = store.value
    if not (isinstance(call, tvm.ir.expr.Call) and call.op.name == "prim.if_then_else"):
        return None
    cond, value, constant = call.args
    if not isinstance(constant, (tirx.FloatImm, tirx.IntImm)) or calls_function(value):
        return None  # a function (EfficientNet's SiLU) costs the write-back more than its own vectorized pass
    handles = [iv.var.__chandle__() for iv in block.iter_vars]
    extents = [int(iv.dom.extent) for iv in block.iter_vars]
    if len(store.indices) != len(handles) or any(
            not isinstance(i, tirx.Var) or i.__chandle__() != h for i, h in zip(store.indices, handles)) \
            or [int(d) for d in store.buffer.shape] != extents:
        return None
    loads = []
    tvm_ffi.structural_walk(value, [(tvm.ir.expr.TensorLoad, loads.append)])
    sources = [load for load in loads if load.source.same_as(source)]
    if not sources or any(not all(tvm_ffi.structural_equal(a, b) for a, b in zip(load.indices, sources[0].indices))
                          for load in sources):
        return None
    analyzer = tvm.sym.Analyzer()
    shifts, axes = [], []
    for k, (index, dim) in enumerate(zip(sources[0].indices, source.shape)):
        used = [j for j, iv in enumerate(block.iter_vars) if uses(index, iv.var)]
        if not used and int(dim) == 1 and isinstance(index, tirx.IntImm) and index.value == 0:
            shifts.append(None), axes.append(None)
            continue
        if len(used) != 1:
            return None
        offset = analyzer.simplify(index - block.iter_vars[used[0]].var)
        if not isinstance(offset, tirx.IntImm) or used[0] in axes:
            return None
        shifts.append(-offset.value), axes.append(used[0])
    if [a for a in axes if a is not None] != sorted(a for a in axes if a is not None) or any(
            extents[j] != 1 for j in range(len(extents)) if j not in axes):
        return None
    bounds = _bounds(cond, block.iter_vars)
    if bounds is None:
        return None
    borders = {}
    for k, j in enumerate(axes):
        if j is None:
            continue
        inside = (shifts[k], shifts[k] + int(source.shape[k]))
        if inside[0] < 0 or inside[1] > extents[j]:
            return None
        if inside != (0, extents[j]):
            borders[j] = inside
        if bounds.pop(j, (0, extents[j])) != inside:
            return None
    if bounds:  # a test on an axis the source does not shift
        return None
    return {"source": source, "shifts": shifts, "axes": axes, "value": value, "constant": constant,
            "borders": borders}


def _bounds(cond, iter_vars) -> dict | None:
    """{axis: (first, end)} that the conjunction `cond` of constant bounds on iteration variables allows,
    or None where it is anything else."""
    bounds = {j: (0, int(iv.dom.extent)) for j, iv in enumerate(iter_vars)}
    tested = set()
    handles = {iv.var.__chandle__(): j for j, iv in enumerate(iter_vars)}
    pending = [cond]
    while pending:
        c = pending.pop()
        if isinstance(c, tirx.And):
            pending += [c.a, c.b]
            continue
        if not isinstance(c, (tirx.LT, tirx.LE, tirx.GT, tirx.GE)):
            return None
        a, b = c.a, c.b
        if isinstance(a, tirx.Var) and isinstance(b, tirx.IntImm) and a.__chandle__() in handles:
            j, v, upper = handles[a.__chandle__()], b.value, isinstance(c, (tirx.LT, tirx.LE))
            strict = isinstance(c, (tirx.LT, tirx.GT))
        elif isinstance(b, tirx.Var) and isinstance(a, tirx.IntImm) and b.__chandle__() in handles:
            j, v, upper = handles[b.__chandle__()], a.value, isinstance(c, (tirx.GT, tirx.GE))
            strict = isinstance(c, (tirx.LT, tirx.GT))
        else:
            return None
        first, end = bounds[j]
        if upper:
            end = min(end, v if strict else v + 1)
        else:
            first = max(first, v + 1 if strict else v)
        bounds[j] = (first, end)
        tested.add(j)
    return {j: bounds[j] for j in tested}


def _stored_by(producer, between, pad_block, pad, shared: bool):
    """`producer` storing the pad's value at the shifted point in place of its map (besides it where the
    map is `shared` with other readers), or None where it is not a plain store of each point of the map (no
    init, no read of it; its indices its iteration variables or 0) or where a nest `between` the two
    touches the pad's output or a map its value reads."""
    store, source = producer.body, pad["source"]
    if not isinstance(store, tirx.BufferStore) or producer.init is not None or not store.buffer.same_as(source) \
            or loads_of(store.value, source):
        return None
    output = pad_block.writes[0].source
    if disturbed_between(between, output, [r.source for r in pad_block.reads if not r.source.same_as(source)]):
        return None
    mapping = {}
    indices = [None] * len(pad_block.iter_vars)
    unit = unit_zeros(producer)
    for k, (index, j) in enumerate(zip(store.indices, pad["axes"])):
        if j is None:
            if not (isinstance(index, tirx.IntImm) and index.value == 0 or index.__chandle__() in unit):
                return None
            continue
        indices[j] = index + pad["shifts"][k]
    for j, iv in enumerate(pad_block.iter_vars):
        if indices[j] is None:
            indices[j] = tirx.const(0, str(iv.var.ty))
        mapping[iv.var.__chandle__()] = indices[j]
    value = tvm_ffi.structural_map(substitute(pad["value"], mapping), [(
        tvm.ir.expr.TensorLoad, lambda x: store.value if x.source.same_as(source) else x)])

    reads = [*producer.reads, *(moved_region(r, mapping) for r in pad_block.reads if not r.source.same_as(source))]
    written = s_tir.stmt.TensorRegion(output, [tvm.ir.Range.from_min_extent(i, 1) for i in indices],
                                      pad_block.writes[0].ty)
    padded = tirx.BufferStore(output, value, indices)
    return s_tir.stmt.SBlock(producer.iter_vars, reads, [*producer.writes, written] if shared else [written],
                             producer.name_hint, tirx.SeqStmt([store, padded]) if shared else padded, None,
                             producer.alloc_buffers, producer.match_buffers, producer.annotations)


def _border(pad_block, pad):
    """Nests storing the pad's constant on its border only (None: no border): for each axis the inside
    test cuts, in order, the points before and after its inside, inside along the axes cut before it."""
    extents = [int(iv.dom.extent) for iv in pad_block.iter_vars]
    cut = sorted(pad["borders"])
    nests = []
    for t, j in enumerate(cut):
        first, end = pad["borders"][j]
        for part in ((0, first), (end, extents[j])):
            if part[1] <= part[0]:
                continue
            ranges = [pad["borders"][i] if i in cut[:t] else part if i == j else (0, extents[i])
                      for i in range(len(extents))]
            nests.append(_constant_nest(pad_block, pad["constant"], ranges, len(nests)))
    if not nests:
        return None
    return tirx.SeqStmt(nests) if len(nests) > 1 else nests[0]


def _constant_nest(pad_block, constant, ranges, number: int):
    """A loop nest over `ranges` (per axis: first, end) storing `constant` into the pad's map, the
    innermost axis in vectors where it is whole."""
    loops = [tirx.Var(f"{iv.var.name}_b", str(iv.var.ty)) for iv in pad_block.iter_vars]
    output = pad_block.writes[0].source
    block = s_tir.stmt.SBlock(pad_block.iter_vars, [], [s_tir.stmt.TensorRegion(
        output, [tvm.ir.Range.from_min_extent(iv.var, 1) for iv in pad_block.iter_vars], pad_block.writes[0].ty)],
        f"{pad_block.name_hint}_border{number}", tirx.BufferStore(output, constant,
                                                                   [iv.var for iv in pad_block.iter_vars]))
    body = s_tir.stmt.SBlockRealize(list(loops), tirx.const(True, "bool"), block)
    last = len(loops) - 1
    for i in reversed(range(len(loops))):
        first, end = ranges[i]
        kind = tirx.ForKind.VECTORIZED if i == last and end - first == int(pad_block.iter_vars[i].dom.extent) \
            and (end - first) % vector_lanes() == 0 and end - first <= 4 * vector_lanes() else tirx.ForKind.SERIAL
        body = tirx.For(loops[i], tirx.const(first, str(loops[i].ty)), tirx.const(end - first, str(loops[i].ty)), kind,
                        body)
    return body


def _bytes(buffer) -> int:
    return math.prod(int(d) for d in buffer.shape) * itemsize(str(buffer.dtype))
