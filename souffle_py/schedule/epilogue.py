"""An elementwise reader computed in a GEMM's or a convolution's tile write-back (CPU default rules)."""

from __future__ import annotations

import logging
import math

import tvm
import tvm_ffi
from tvm import s_tir, tirx

from souffle_py.failures import not_applied
from souffle_py.schedule.blocks import block_kind, calls_function, conjuncts_kept, realize_predicate
from souffle_py.schedule.flat import when_scheduled
from souffle_py.schedule.ragged import PENDING_FOLD
from souffle_py.ir.exprs import substitute

log = logging.getLogger(__name__)

# an elementwise reader to be computed in the write-back block named by the mark when the schedule is
# finished (`inline_tile_epilogues`): the default rules leave it as it is
TILE_EPILOGUE = "souffle.tile_epilogue"


def fuse_elementwise_epilogue(sch, write_back, requantize: bool = False) -> str | None:
    """Compute the elementwise block that alone reads a convolution's or a GEMM's output (batch norm + ReLU,
    a residual add, a bias add) in its write-back of each register tile, while the tile is in registers:
    one pass over the map and one intermediate map fewer (ONNX Runtime's fused Conv + Add + ReLU). Left
    alone when the output has other readers or is the function's output, which TVM's reverse_compute_inline
    refuses, and when the block calls a function (EfficientNet's SiLU), which costs the conv's write-back
    more than its own vectorized pass does (EfficientNet-b0 ~2% slower with it fused). A reader that TVM
    cannot inline, a residual add whose other map is computed in the same kernel (TVM inlines only readers
    of one such map), is marked and inlined when the schedule is finished (`_mark_for_write_back`).
    `requantize`: a reader that rounds (a requantization) is computed there too, for a write-back of whole
    vectors (not one transposing its tile element by element, where a requantizing residual add cost
    ResNet-50's stage-2 and 3 int8 convs 2-3x their own time). Returns "inlined" or "marked" where the
    reader went into the write-back, else None."""
    readers = sch.get_consumers(write_back)
    if len(readers) != 1 or block_kind(sch, readers[0]) != "injective" or calls_function(sch.get(readers[0]).body,
                                                                                           rounding=requantize):
        return None
    # TVM's reverse_compute_inline gives the write-back the reader's predicate in place of its own: a
    # masked tile's write-back with a reader outside the channel blocks (c < C) then stored past its row.
    # A masked write-back is inlined on a copy first (the copy's queries stay out of this schedule's trace).
    before = realize_predicate(sch, write_back)
    if before is not None:
        name = sch.get(write_back).name_hint
        trial = sch.copy()
        try:
            trial.reverse_compute_inline(trial.get_sblock(sch.get(readers[0]).name_hint))
        except Exception as exc:  # noqa: BLE001  (tvm.s_tir.ScheduleError: checked before anything changes)
            not_applied("tile epilogue inlining", name, exc, "its epilogue marked for the write-back")
            return "marked" if _mark_for_write_back(sch, write_back, readers[0]) else None
        if not conjuncts_kept(realize_predicate(trial, trial.get_sblock(name)), before):
            log.debug("conv epilogue of %s not fused: its write-back would lose its predicate %s", name, before)
            return None
    try:
        sch.reverse_compute_inline(readers[0])
    except Exception as exc:  # noqa: BLE001  (tvm.s_tir.ScheduleError: checked before anything changes)
        not_applied("tile epilogue inlining", sch.get(write_back).name_hint, exc,
                    "its epilogue marked for the write-back")
        return "marked" if _mark_for_write_back(sch, write_back, readers[0]) else None
    return "inlined"


def is_intermediate(sch, buffer) -> bool:
    """Whether `buffer` is a map the function allocates at its root (not one of its parameters, whose
    shape the caller's array has): a map whose layout a schedule may change."""
    return any(b.same_as(buffer) for b in sch.get(sch.get_sblock("root")).alloc_buffers)


def fuse_epilogue_chain(sch, write_back, links: int, waited: bool = False) -> None:
    """`fuse_elementwise_epilogue`, then the elementwise reader of the reader, up to `links` readers in all,
    each alone in reading the one before: a dynamically quantized GEMM's scaling and bias, then its GELU
    (BERT's FFN: one pass over the 128 x 3072 map fewer); readers that round too (a static QDQ GEMM's
    requantization and bias add, then its GELU's quantization: the int8 GEMM's write-back, its one caller)."""
    readers = sch.get_consumers(write_back)
    if len(readers) == 1 and PENDING_FOLD in sch.get(readers[0]).annotations:  # a padded result's copy, folded
        name = sch.get(write_back).name_hint  # into the write-back once the rules are done: the epilogues after it
        if waited:
            log.debug("epilogues of %s left apart: its padded result's copy was not folded", name)
            return
        when_scheduled(name, lambda: fuse_epilogue_chain(sch, sch.get_sblock(name), links, True),
                       "tile epilogue fusion", "its epilogues apart", before_partitions=True)
        return
    kind, reader = fuse_elementwise_epilogue(sch, write_back, requantize=True), None
    if kind == "marked":
        reader = sch.get_consumers(write_back)[0]
    for _ in range(links - 1):
        if kind == "inlined":  # the write-back stores the reader's map now: its reader is the next one
            kind = fuse_elementwise_epilogue(sch, write_back, requantize=True)
            reader = sch.get_consumers(write_back)[0] if kind == "marked" else None
            continue
        if kind != "marked":
            return
        following = sch.get_consumers(reader)
        if (len(following) != 1 or block_kind(sch, following[0]) != "injective"
                or calls_function(sch.get(following[0]).body, rounding=True)
                or not _mark_for_write_back(sch, write_back, following[0], source=reader)):
            return
        reader = following[0]


def _mark_for_write_back(sch, write_back, reader, source=None) -> bool:
    """Mark `reader` to be computed in `write_back` when the schedule is finished (`inline_tile_epilogues`):
    each tile then goes through the reader's arithmetic while in registers, instead of the map from memory
    in a pass of its own (ResNet-50's residual Add + ReLU over 56 x 56 x 256: 0.13-0.18 ms each apart).
    Only a reader that maps each output point to the same point of the map (no broadcast of it, no
    transpose), whose other maps are all computed in nests before the write-back's. `source`: the block
    whose map the reader reads (a reader marked before it, `fuse_epilogue_chain`), else the write-back.
    Returns whether it marked the reader."""
    source = write_back if source is None else source
    if not _reads_pointwise(sch.get(reader), sch.get(source).writes[0].source):
        log.debug("epilogue %s left apart: it does not read its producer point by point", sch.get(reader).name_hint)
        return False
    nest = _nest_index(sch, write_back)
    others = [_nest_index(sch, p) for p in sch.get_producers(reader) if not sch.get(p).same_as(sch.get(source))]
    if nest is None or any(other is None or other >= nest for other in others):
        log.debug("epilogue %s left apart: a map it reads is computed after %s", sch.get(reader).name_hint,
                  sch.get(write_back).name_hint)
        return False
    sch.annotate(reader, TILE_EPILOGUE, sch.get(write_back).name_hint)
    return True


def _nest_index(sch, block) -> int | None:
    """The position, among the root block's statements, of the loop nest that holds `block` (None: not found)."""
    root = sch.get(sch.get_sblock("root"))
    sref = sch.get_sref(block)
    while sref.parent is not None and not sref.parent.stmt.same_as(root):
        sref = sref.parent
    nests = list(root.body.seq) if isinstance(root.body, tirx.SeqStmt) else [root.body]
    return next((i for i, nest in enumerate(nests) if nest.same_as(sref.stmt)
                 or getattr(nest, "block", None) is not None and nest.block.same_as(sref.stmt)), None)


def _reads_pointwise(stmt, buffer) -> bool:
    """Whether the block `stmt` loads `buffer` at one point per iteration, the whole of it (its iteration
    variables the indices, each spanning its axis; an iteration variable of extent 1 and the constant 0
    alike), and stores a map of as many points at the same place in memory: the same indices in a map of
    the same shape, or the same row-major position in another shape (a 1 x 1 convolution's sum over flat
    pixels read by a reader of the NCHW map, int8_pixel_conv.py). A reader of part of the map (its
    channels but the padding) is not one: its store would go past its own map in the write-back's tiles."""
    store = stmt.body
    if not isinstance(store, tirx.BufferStore) or _size(store.buffer) != _size(buffer) or _size(buffer) is None:
        return False
    loads = []
    tvm_ffi.structural_walk(store.value, [(tvm.ir.expr.TensorLoad, loads.append)])
    mine = [load for load in loads if load.source.same_as(buffer)]
    if not mine:
        return False
    unit = unit_zeros(stmt)
    first = [substitute(i, unit) for i in mine[0].indices]
    if not all(len(load.indices) == len(first) and all(
            tvm_ffi.structural_equal(substitute(a, unit), b) for a, b in zip(load.indices, first)) for load in mine):
        return False
    extents = {iv.var.__chandle__(): int(iv.dom.extent) for iv in stmt.iter_vars}
    spanned = set()
    for index, dim in zip(first, buffer.shape):
        if int(dim) > 1 and isinstance(index, tirx.Var) and extents.get(index.__chandle__()) == int(dim):
            spanned.add(index.__chandle__())
        elif not (int(dim) == 1 and isinstance(index, tirx.IntImm) and index.value == 0):
            return False
    if len(spanned) != len([d for d in buffer.shape if int(d) > 1]):
        return False
    stored = [substitute(i, unit) for i in store.indices]
    if _same_shape(store.buffer, buffer):
        return all(tvm_ffi.structural_equal(a, b) for a, b in zip(stored, first))
    analyzer = tvm.sym.Analyzer()
    for iv in stmt.iter_vars:
        analyzer.bind(iv.var, tvm.ir.Range(0, int(iv.dom.extent)))
    offset = analyzer.simplify(_row_major(stored, store.buffer.shape) - _row_major(first, buffer.shape))
    return isinstance(offset, tirx.IntImm) and offset.value == 0


def _size(buffer) -> int | None:
    if not all(isinstance(d, tirx.IntImm) for d in buffer.shape):
        return None
    return math.prod(int(d) for d in buffer.shape)


def _row_major(indices, shape):
    flat = tirx.const(0, "int32")
    for index, dim in zip(indices, shape):
        flat = flat * dim + index
    return flat


def unit_zeros(block) -> dict:
    """The block's iteration variables of extent 1, each mapped to 0 (substitute's handle -> expression)."""
    return {iv.var.__chandle__(): tirx.const(0, "int32") for iv in block.iter_vars if int(iv.dom.extent) == 1}


def _same_shape(a, b) -> bool:
    return len(a.shape) == len(b.shape) and all(isinstance(x, tirx.IntImm) and isinstance(y, tirx.IntImm)
                                                and x.value == y.value for x, y in zip(a.shape, b.shape))


def inline_tile_epilogues(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` (scheduled) with each marked reader (`_mark_for_write_back`) computed in its write-back block
    and its own nest and intermediate map gone: what TVM's reverse_compute_inline does, without its rule
    that the reader read no other map computed in the function. A mark whose conditions no longer hold
    stays a plain nest of its own."""
    if (found := root_nests(func)) is None:
        return func
    nests, alloc = found
    blocks = [blocks_in(nest) for nest in nests]
    changed = False
    for r, reader in ((i, b) for i, found in enumerate(blocks) for b in found if TILE_EPILOGUE in b.annotations):
        name = str(reader.annotations[TILE_EPILOGUE])
        w = next((i for i, found in enumerate(blocks) if any(b.name_hint == name for b in found)), None)
        fused = None if w is None or len(blocks[r]) != 1 else _fused_write_back(
            next(b for b in blocks[w] if b.name_hint == name), reader, blocks[w:r], alloc)
        if fused is None:
            log.warning("epilogue %s not computed in %s: it stays a nest of its own", reader.name_hint, name)
            continue
        write_back, buffer = fused
        nests[w] = tvm_ffi.structural_map(nests[w], [(s_tir.stmt.SBlock, lambda b: write_back if b.name_hint == name
                                                        else b)])
        blocks[w] = blocks_in(nests[w])
        nests[r], blocks[r] = None, []
        alloc = [b for b in alloc if not b.same_as(buffer)]
        changed = True
    return with_root_nests(func, nests, alloc) if changed else func


def root_nests(func: tirx.PrimFunc):
    """(the root block's loop nests, its allocated maps) of a scheduled function, or None where its body is
    not a root block."""
    realize = func.body
    if not isinstance(realize, s_tir.stmt.SBlockRealize):
        return None
    root = realize.block
    return list(root.body.seq) if isinstance(root.body, tirx.SeqStmt) else [root.body], list(root.alloc_buffers)


def with_root_nests(func: tirx.PrimFunc, nests, alloc) -> tirx.PrimFunc:
    """`func` whose root block holds `nests` (those not None) and allocates `alloc`."""
    realize = func.body
    root = realize.block
    kept = [nest for nest in nests if nest is not None]
    new_root = s_tir.stmt.SBlock(root.iter_vars, root.reads, root.writes, root.name_hint,
                                 tirx.SeqStmt(kept) if len(kept) > 1 else kept[0], root.init, alloc,
                                 root.match_buffers, root.annotations)
    return tirx.PrimFunc(func.params, s_tir.stmt.SBlockRealize(realize.iter_values, realize.predicate, new_root),
                         func.ret_type, func.attrs)


def blocks_in(nest) -> list:
    """The blocks under a loop nest (none under None)."""
    found = []
    if nest is not None:
        tvm_ffi.structural_walk(nest, [(s_tir.stmt.SBlock, found.append)])
    return found


def disturbed_between(between, output, others, skip=None) -> bool:
    """Whether a block of the nests `between` (their blocks, nest by nest; `skip` aside) reads or writes
    `output` or writes one of the maps `others`: then a computation moved from after them to before them
    would change what the function computes."""
    for found in between:
        for block in found:
            if skip is not None and block.same_as(skip):
                continue
            touched = [region.source for region in (*block.reads, *block.writes)]
            if any(b.same_as(output) for b in touched) or any(
                    region.source.same_as(o) for region in block.writes for o in others):
                return True
    return False


def loads_of(expr, buffer) -> list:
    """The loads of `buffer` in `expr`."""
    found = []
    tvm_ffi.structural_walk(expr, [(tvm.ir.expr.TensorLoad, lambda x: found.append(x) if x.source.same_as(buffer)
                                    else None)])
    return found


def moved_region(region, mapping: dict):
    """A block's access region with the variables of `mapping` (substitute's handles) replaced."""
    return s_tir.stmt.TensorRegion(region.source, [tvm.ir.Range.from_min_extent(
        substitute(r.min, mapping), substitute(r.extent, mapping)) for r in region.region], region.ty)


def _fused_write_back(write_back, reader, between, alloc):
    """(the write-back block storing `reader`'s value in its place, the intermediate map it no longer
    stores), or None where that would change what the function computes: the map is not an intermediate
    read by `reader` alone, or a map the reader reads or writes is written or read in the nests `between`
    (the write-back's through the reader's)."""
    store, own = write_back.body, reader.body
    if not isinstance(store, tirx.BufferStore) or not isinstance(own, tirx.BufferStore) or len(reader.writes) != 1:
        return None
    buffer = store.buffer
    if not any(b.same_as(buffer) for b in alloc) or not _reads_pointwise(reader, buffer):
        return None
    others = [region.source for region in reader.reads if not region.source.same_as(buffer)]
    output = reader.writes[0].source
    if disturbed_between(between, output, others, skip=reader) or any(
            region.source.same_as(buffer) for found in between for block in found if not block.same_as(reader)
            for region in block.reads):
        return None
    loads = loads_of(own.value, buffer)
    mapping = unit_zeros(reader)
    unit = set(mapping)
    for index, target in zip(loads[0].indices, store.indices):
        if isinstance(index, tirx.Var) and index.__chandle__() not in unit:
            mapping[index.__chandle__()] = target
    if any(iv.var.__chandle__() not in mapping for iv in reader.iter_vars):
        return None
    value = tvm_ffi.structural_map(substitute(own.value, mapping), [(
        tvm.ir.expr.TensorLoad, lambda x: store.value if x.source.same_as(buffer) else x)])
    body = tirx.BufferStore(output, value, [substitute(i, mapping) for i in own.indices])

    reads = [*write_back.reads, *(moved_region(r, mapping) for r in reader.reads if not r.source.same_as(buffer))]
    fused = s_tir.stmt.SBlock(write_back.iter_vars, reads, [moved_region(reader.writes[0], mapping)],
                              write_back.name_hint, body,
                              write_back.init, write_back.alloc_buffers, write_back.match_buffers,
                              write_back.annotations)
    return fused, buffer
