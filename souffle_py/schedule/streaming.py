"""Weight streaming for dense convolutions and GEMMs over few rows (CPU): when to reduce in pieces, and the
software prefetch of the next piece, inserted into the scheduled function.

Why: a 1x1 convolution over a small map (ResNeXt-101's 1024 -> 1024 at 14 x 14) reads 4 MB of weights
once per inference and reuses each weight only 14 times, so in a real inference, where the weights come
from memory, the hardware prefetcher leaves it waiting: 1.33 ms alone, 1.60 ms in a chain of such convs,
against 1.36 for ONNX Runtime's MLAS. The conv and GEMM rules (rules/conv_tile.py, rules/gemm_panel.py) reduce in pieces
outside the spatial tiles, as MLAS does (`stream_piece` decides), and mark two loops: the piece loop
(PIECE: a piece's size in elements of one weight block or panel) and the reduction loop inside each tile
(AT: the weight buffer's name). `inject_weight_prefetch` makes each tile fetch its share of its block's
next piece into L2 before reducing the current one (in the chain: 1.59 -> 1.45 ms; ResNeXt-101 1.07x ->
1.00x ONNX Runtime). A prefetch has no effect on values, and one past the weights is clamped to them.
"""

from __future__ import annotations

import logging
import math

import tvm
import tvm_ffi
from tvm import s_tir, tirx

from souffle_py.host import num_threads
from souffle_py.schedule.blocks import has_annotated_loop, uses
from souffle_py.ir.analysis.tensor_level import itemsize
from souffle_py.ir.exprs import substitute
from souffle_py.schedule.thresholds import L2_CHUNK_BYTES, STREAM_OUTPUT_BYTES  # noqa: F401  (L2_CHUNK_BYTES: re-exported)
from souffle_py.schedule.thresholds import STREAM_BALANCE, STREAM_MIN_CHUNKS, STREAM_PIECE

log = logging.getLogger(__name__)

PIECE = "souffle_prefetch_piece"
AT = "souffle_prefetch_at"
EACH = "souffle_prefetch_each"  # a loop inside the tile over several weight blocks (a conv's filter set):
                                # each block's next piece is fetched
CACHE_LINE = 64
L2 = 2  # the prefetch intrinsic's locality: keep in L2 and below


def stream_piece(reduction: int, chunks: int, chunk_output_bytes: int) -> int:
    """Reduction elements per piece for an operator whose weights exceed L2 (in `chunks` chunks of output
    channels, each writing `chunk_output_bytes`), else 0: streamed where the chunks keep the threads busy
    and each chunk's output stays in L2 (a small map, 14 x 14 or 7 x 7, or a GEMM of few rows, where each
    weight is reused by few tiles). A piece is the largest divisor of the reduction up to STREAM_PIECE
    that leaves at least two pieces, and at least a quarter of STREAM_PIECE."""
    threads = num_threads()
    if chunks < STREAM_MIN_CHUNKS or chunk_output_bytes > STREAM_OUTPUT_BYTES \
            or -(-chunks // threads) * threads > STREAM_BALANCE * chunks:
        return 0
    piece = max((d for d in range(1, STREAM_PIECE + 1) if reduction % d == 0 and reduction // d >= 2), default=0)
    return piece if piece >= STREAM_PIECE // 4 else 0


def inject_weight_prefetch(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` with the weight prefetches the marked piece loops ask for, and the marks removed."""
    if not streams_weights(func):
        return func
    def prefetch(loop):  # children first: the marked reduction loop is seen before its piece loop
        return _unmarked(loop, _with_prefetch(loop)) if PIECE in loop.annotations else loop

    def unmark(loop):
        return _unmarked(loop, loop.body) if AT in loop.annotations or EACH in loop.annotations else loop
    body = tvm_ffi.structural_map(func.body, [(tirx.For, prefetch)])
    return func.with_body(tvm_ffi.structural_map(body, [(tirx.For, unmark)]))


def _unmarked(loop: tirx.For, body) -> tirx.For:
    rest = {k: v for k, v in loop.annotations.items() if k not in (PIECE, AT, EACH)}
    return tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind, body, loop.thread_binding, rest)


def streams_weights(func: tirx.PrimFunc) -> bool:
    """Whether a scheduled function has a piece loop marked for weight streaming."""
    return has_annotated_loop(func, PIECE)


def _with_prefetch(piece_loop: tirx.For) -> tirx.Stmt:
    """The piece loop's body with a prefetch ahead of its marked reduction loop; unchanged (and logged)
    where the tiles between them are not a perfect loop nest or the weight read cannot be found."""
    tiles, node = [], piece_loop.body
    while isinstance(node, tirx.For) and AT not in node.annotations:
        tiles.append(node)
        node = node.body
    if not isinstance(node, tirx.For):
        log.debug("weight prefetch skipped: the tiles under %s are not a perfect nest", piece_loop.loop_var)
        return piece_loop.body
    load = _weight_load(node, str(node.annotations[AT]))
    if load is None:
        log.debug("weight prefetch skipped: no read of %s under %s", node.annotations[AT], node.loop_var)
        return piece_loop.body
    shape = [int(d) for d in load.source.shape]
    offset = 0
    for index, extent in zip(load.indices, shape):
        offset = offset * extent + index
    each = [loop for loop in _loops(node) if EACH in loop.annotations]
    offset = substitute(offset, {v.__chandle__(): v * 0 for v in _loop_vars(node)
                                 if not any(v.same_as(loop.loop_var) for loop in each)})  # the tile's first element
    var = piece_loop.loop_var
    following = substitute(offset, {var.__chandle__(): var + 1})
    sharing = [loop for loop in tiles if not uses(offset, loop.loop_var)]  # the tiles reading the same block
    tile, count = tirx.const(0, "int32"), 1
    for loop in sharing:
        tile, count = tile * loop.extent + loop.loop_var, count * int(loop.extent)
    per_line = CACHE_LINE // itemsize(load.source.dtype)
    lines = math.ceil(int(piece_loop.annotations[PIECE]) / per_line)
    per_tile = math.ceil(lines / count)
    line = tirx.Var("prefetch_line", "int32")
    flat = tirx.min(following + (tile * per_tile + line) * per_line, math.prod(shape) - 1)
    address = load.source.access_ptr("r", offset=flat)  # a flat offset: no index arithmetic per prefetch
    prefetch = tirx.For(line, 0, per_tile, tirx.ForKind.SERIAL,
                        tirx.Evaluate(tirx.call_intrin("void", "tirx.prefetch", address, 0, L2, 1)))
    for loop in each:  # the tile's blocks, one after another
        prefetch = tirx.For(loop.loop_var, loop.min, loop.extent, tirx.ForKind.SERIAL, prefetch)

    def prepend(loop):
        return tirx.SeqStmt([prefetch, loop]) if loop.same_as(node) else loop
    return tvm_ffi.structural_map(piece_loop.body, [(tirx.For, prepend)])


def _weight_load(loop: tirx.For, name: str):
    """The read of buffer `name` in the block under `loop`, its indices in terms of the loop variables."""
    found = []

    def visit(realize):
        block = realize.block
        loads = []
        tvm_ffi.structural_walk(block.body, [(tvm.ir.expr.TensorLoad,
                                              lambda l: loads.append(l) if l.source.name == name else None)])
        if loads and not found:
            binding = {iv.var.__chandle__(): value for iv, value in zip(block.iter_vars, realize.iter_values)}
            found.append(tirx.BufferLoad(loads[0].source, [substitute(i, binding) for i in loads[0].indices]))
    tvm_ffi.structural_walk(loop.body, [(s_tir.stmt.SBlockRealize, visit)])
    return found[0] if found else None


def _loops(loop: tirx.For) -> list:
    """`loop` and every loop inside it."""
    found = [loop]
    tvm_ffi.structural_walk(loop.body, [(tirx.For, found.append)])
    return found


def _loop_vars(loop: tirx.For) -> list:
    """`loop`'s variable and every loop variable inside it."""
    return [f.loop_var for f in _loops(loop)]
