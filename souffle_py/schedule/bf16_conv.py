"""The CPU's bfloat16 convolution micro-kernel: the GEMM's `vdpbf16ps` tensor intrinsic (bf16_gemm.py) over
the convolutions that te_passes/precision_conv.py converted.

Such a convolution reduces over channel pairs (cp, the taps, p) and reads its weight packed
Wp[f // 16, cp, r, s, f % 16, p], so 16 output channels x one pair of input channels is one instruction:
the input pair of one pixel (32 bits, broadcast over the lanes) times one 64-byte weight row. The register
tile is a row of output pixels x one or two vectors of output channels (`tile_pixels()` pixels: each one's
accumulators and broadcast input in registers, beside the weight rows), the channel pairs and taps outside
it; output-channel blocks innermost of the parallel tiles, so that a
tile's input stays in L1 for every block, in chunks whose packed weights stay in L2. The float32
accumulators are written back once per tile, as whole vectors over channel blocks (transposed into an
NCHW output).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from tvm import s_tir

from souffle_py.failures import RuleDoesNotApply, not_applied, rule_failed
from souffle_py.schedule.bf16_gemm import L2_CHUNK_BYTES, LANES, divisor_at_most, finish_dot_tiles
from souffle_py.schedule.blocks import block_loops, loop_extent, vector_registers
from souffle_py.schedule.reductions import schedule_reduction

MAX_VECTORS = 2    # output-channel vectors per tile (each input pair broadcast feeds this many instructions)


def tile_pixels(vectors: int, operand_registers: int = 1) -> int:
    """Output pixels per tile: each holds `vectors` accumulators and its own broadcast input (LLVM keeps each
    pixel's broadcast pair or quad in a register, not folded into the instruction), beside `vectors` weight
    rows: (registers - vectors) // (vectors + 1), 10 pixels x 2 vectors of AVX-512's 32. At 14 pixels (28
    accumulators, the registers' count before) int8 3 x 3 convs of ResNet-50's shapes ran at 410-870 GOP/s
    here, at 7-8 pixels 1190-1400. `operand_registers`: the registers each loaded operand takes (2 where the
    instruction is emulated on split halves, int8_dot.py)."""
    per = operand_registers
    return max(1, (vector_registers() - per * vectors) // (vectors + per))


def row_pixels(operand_registers: int = 1) -> int:
    """Output pixels of a tile of one vector of output channels, where `tile_pixels` leaves a row's width no
    divisor above 1 (AVX2's 3 pixels on ResNet-50's 7 x 7 maps): one accumulator per pixel beside the
    weight vector and one pixel's input at a time (LLVM loads each pixel's broadcast just before its
    instructions; 16 vector registers: 12 pixels with split operands)."""
    return max(1, vector_registers() - 2 * operand_registers)


def schedule_bf16_conv(sch: s_tir.Schedule, block) -> None:
    """The micro-kernel tiles (module docstring), tried on a scratch schedule first; where tensorize
    refuses them, a warning and a plain reduction schedule. Where no scratch schedule can be made, they are
    applied directly: a primitive that fails changes nothing, so what went before stays a valid (slower)
    schedule."""
    schedule_dot_conv(sch, block, DotConv("bf16", "vdpbf16ps", 2, 2, finish_dot_tiles, LANES))


@dataclass(frozen=True)
class DotConv:
    """A dot-product instruction's convolution tiles: `depth` input channels per lane (the innermost
    reduction), weights of `item_bytes`, and the end of the schedule that tensorizes onto it."""

    kind: str
    instruction: str
    depth: int
    item_bytes: int
    finish: Callable  # (sch, block, parallel loop, reduction loop, lanes loop, unrolled loops)
    lanes: int        # accumulator lanes of one instruction
    operand_registers: int = 1  # vector registers per loaded operand (tile_pixels)


def schedule_dot_conv(sch: s_tir.Schedule, block, dot: DotConv) -> str | None:
    """`dot`'s tiles (schedule_bf16_conv); returns the name of the accumulators' write-back block, None
    where a plain reduction schedule had to do."""
    name = sch.get(block).name_hint
    trial = scratch_schedule(sch)
    try:
        made = _conv_tiles(trial if trial is not None else sch, trial.get_sblock(name) if trial is not None else block,
                           dot)
    except Exception as exc:  # noqa: BLE001  (tvm.s_tir.ScheduleError from tensorize or blockize)
        rule_failed(f"{dot.kind} conv tiles ({dot.instruction})", name, exc, "a plain reduction")
        if trial is not None:
            schedule_reduction(sch, block)
        return None
    return _conv_tiles(sch, block, dot) if trial is not None else made


def scratch_schedule(sch: s_tir.Schedule):
    """A scratch schedule of sch's current function, or None: a new Schedule re-checks the whole function
    (and refuses one whose fast-math expressions share a let variable), and TVM cannot copy a schedule
    state that holds tensorized blocks."""
    for make in (lambda: s_tir.Schedule(sch.mod), sch.copy):
        try:
            return make()
        except Exception:  # tvm.error.InternalError, ValueError (ill-formed TIR)
            continue
    return None


def _conv_tiles(sch: s_tir.Schedule, block, dot: DotConv) -> str:
    stmt = sch.get(block)
    spatial = sum(1 for iv in stmt.iter_vars if int(iv.iter_type) == 0)
    loops = block_loops(sch, block)
    if len(loops) != len(stmt.iter_vars):
        raise RuleDoesNotApply("inside a time loop")
    (*axes, x), (cp, *taps, p) = loops[:spatial], loops[spatial:]
    if spatial == 5:  # [N, F / B, H, W, B]: the channel block and its lanes
        n, blocks, y = axes[0], axes[1], axes[2]
        x, lanes = axes[3], x
    else:  # [N, F, H, W]
        n, f, y = axes
        width = dot.lanes * MAX_VECTORS if loop_extent(sch, f) % (dot.lanes * MAX_VECTORS) == 0 else dot.lanes
        blocks, lanes = sch.split(f, [None, width])
    vectors = loop_extent(sch, lanes) // dot.lanes
    columns = divisor_at_most(loop_extent(sch, x), tile_pixels(min(vectors, MAX_VECTORS), dot.operand_registers))
    row = divisor_at_most(loop_extent(sch, x), row_pixels(dot.operand_registers))
    single = columns == 1 < row  # a one-pixel tile reuses no weight load: one vector over more pixels instead
    if vectors > MAX_VECTORS or (single and vectors > 1):
        blocks_inner, lanes = sch.split(lanes, [None, (1 if single else MAX_VECTORS) * dot.lanes])
        blocks = sch.fuse(blocks, blocks_inner)
        vectors = 1 if single else MAX_VECTORS
        columns = row if single else columns
    fv, fl = sch.split(lanes, [vectors, dot.lanes])
    xo, xi = sch.split(x, [None, columns])
    count = loop_extent(sch, blocks)
    weight_bytes = loop_extent(sch, cp) * dot.depth * vectors * dot.lanes * dot.item_bytes
    for tap in taps:
        weight_bytes *= loop_extent(sch, tap)
    per = max(d for d in range(1, count + 1) if count % d == 0 and d * weight_bytes <= max(L2_CHUNK_BYTES, weight_bytes))
    chunk, blocks = sch.split(blocks, [None, per])
    sch.reorder(chunk, n, y, xo, blocks, cp, *taps, xi, fv, fl, p)
    acc = sch.cache_write(block, 0, "local")
    sch.reverse_compute_at(acc, blocks)
    if spatial == 4:  # lanes adjacent in the accumulator; the write-back transposes into NCHW
        sch.transform_layout(block, ("write", 0), lambda b, c, h, w: [b, h, w, c])
        sch.unroll(block_loops(sch, acc)[-1])
    else:
        sch.vectorize(block_loops(sch, acc)[-1])
    dot.finish(sch, block, sch.fuse(chunk, n, y, xo, blocks), cp, fl, (xi, fv))
    return sch.get(acc).name_hint
