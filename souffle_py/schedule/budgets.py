"""The GEMM register tile's budgets on the CPU being compiled for (cpu_target.CpuTarget.current()): rows,
columns and accumulator registers, in the target's vector lanes and registers. Read by the GEMM rule
(rules/gemm_panel.py), the gate groups (gates.py) and the weight panels the CPU backend packs (te_passes/layout.py).
Also the int8 pixel-lane conv tile's input panel against the target's L1d (int8_pixel_conv.py, int8_conv_vnni.py)."""

from __future__ import annotations

from souffle_py.cpu_target import CpuTarget
from souffle_py.schedule.blocks import vector_lanes, vector_registers
from souffle_py.schedule.thresholds import PIXEL_PANEL_L1_SHARE


def gemm_tile_rows() -> int:
    """Rows of the GEMM register tile: 8 (16 accumulators of two vectors) with 32 vector registers, 4 with 16."""
    return 8 if vector_registers() >= 32 else 4


def gemm_tile_columns() -> int:
    """Columns of the GEMM register tile, two vectors; also the weight panels' width (te_passes/layout.py)."""
    return 2 * vector_lanes()


def gemm_accumulators() -> int:
    """Vector registers of accumulators a GEMM tile may take: 20 of 32 (AVX-512, AArch64; the rest hold the
    weight vectors and the broadcast row value), 8 of 16 (AVX2)."""
    return 20 if vector_registers() >= 32 else 8


def gemv_tile_lanes() -> int:
    """Accumulator lanes of the default GEMV's tile (one row, rules/gemm_panel.register_tile): the most vectors, a power
    of two, within gemm_accumulators() (16 vectors of 32 registers, 8 of 16)."""
    vectors = 1
    while 2 * vectors <= gemm_accumulators():
        vectors *= 2
    return vectors * vector_lanes()


def pixel_panel_fits(vectors: int, depth_quads: int, lanes: int) -> bool:
    """Whether an int8 pixel-lane conv tile of `vectors` rows of input per channel quad (`lanes` pixels x 4
    bytes each), over `depth_quads` quads, stays within PIXEL_PANEL_L1_SHARE of the target's L1d: every
    channel tile reads it again (schedule/int8_pixel_conv.tile_shape, te_passes/int8_conv_vnni.py's
    padding)."""
    return depth_quads * vectors * lanes * 4 <= PIXEL_PANEL_L1_SHARE * CpuTarget.current().l1d_bytes
