"""The convolution rule's register budgets (counts of the target's vector registers) and `Variant`, the knob
set that variants.py measures at compile time; the rule itself is rules/conv_tile.py, whose budgets these
are (the layout passes and variants.py read them too)."""

from __future__ import annotations

import contextvars
import dataclasses

from souffle_py.schedule.blocks import vector_lanes, vector_registers

CONV_MIN_LANES = 4


# Register budgets: counts of the target's vector registers (cpu_target.CpuTarget.registers), measured with
# 32 (AVX-512: Zen 5, and this Xeon), as a fraction of them or as all of them less what the tile's other
# operands take; with 32 registers they are the numbers measured.
def conv_max_lanes() -> int:
    """The widest vector tried for a convolution: two registers (dense convs, whose weights
    te_passes/conv_layout.py blocks by this many output channels)."""
    return 2 * vector_lanes()


def conv_weight_blocks() -> tuple[int, ...]:
    """Output channels per block of a conv weight (te_passes/conv_weights.py: the first that divides the
    filters, else all of them): one vector of float32, else half of one, the halves a narrower vector or a
    two-block tile still loads whole (16, 8 with AVX-512; 8, 4 with AVX2; 4 alone with NEON, whose half
    vector is below CONV_MIN_LANES). Dense convs are re-blocked by conv_max_lanes later (conv_layout.py);
    depthwise ones keep this block, the channel block of their input (vector_lanes)."""
    lanes = vector_lanes()
    return tuple(b for b in (lanes, lanes // 2) if b >= CONV_MIN_LANES) or (lanes,)


def conv_lanes() -> tuple[int, ...]:
    """Vector widths a conv tile may take: powers of two only. Any other divisor (a 1x1 conv over 104
    channels took 26 or 28 lanes) is a vector LLVM builds element by element (588 vinsertps: 23.7x ONNX
    Runtime); channel counts that no power of two divides are padded up to the block instead."""
    lanes = vector_lanes()
    return tuple(w for w in (2 * lanes, lanes, lanes // 2, lanes // 4) if CONV_MIN_LANES <= w <= conv_max_lanes())


def conv_accumulator_lanes() -> int:
    """Partial sums kept in registers: 14 of 32 registers (224 lanes with AVX-512)."""
    return vector_registers() * 14 // 32 * vector_lanes()


def conv_broadcast_accumulator_lanes() -> int:
    """... all registers but 4 (28 of 32, 448 lanes) where the input is one broadcast value per row and the
    reduction has CONV_LONG_REDUCTION terms or more (a dense conv's 32 channels x 14 columns: the weight's two
    vectors and the broadcast take the other registers; 1x1 convs at 14 x 14 152 -> 161 GFLOP/s; over 16 or
    27 terms, EfficientNet's stem and first expand conv, 1.2-2x slower)."""
    return (vector_registers() - 4) * vector_lanes()


def conv_window_accumulators() -> int:
    """... and at most 20 of 32 registers of them where the innermost reduction is a kernel window of at most
    CONV_UNROLLED_TAPS taps, which is unrolled (blocks.unrolled_window; by LLVM where TAPS_UNROLLED does not)
    (3x3 convs in 32-channel blocks over 13 or 14 columns spill: 64 -> 256 at 13 x 13 0.237 -> 0.184 ms,
    256 -> 256 strided to 14 x 14 1.32 -> 0.77-0.83 ms, both as 5 columns x 2 blocks); filter sets keep
    their registers."""
    return vector_registers() * 20 // 32


def conv_filter_set_registers() -> int:
    """Partial sums and weight vectors of a filter set (rules/conv_tile._filter_set): all registers less the
    broadcast input and spare ones (28 of 32)."""
    return vector_registers() - 4


def taps_unrolled_registers() -> int:
    """Registers a window's tile may need and still be unrolled (conv_tile._window_registers): 36 with 32 (9/8 of
    them; more than the machine has, as LLVM reuses some). LLVM left a 7x1 window over 6 columns x 2 blocks a
    loop (34 registers), and a 3x3's kh; unrolled, single convs alternated ran 5-13% faster (7x1 at 17 x 17,
    160 and 192 channels, 0.357 -> 0.328 and 0.480 -> 0.425 ms; 3x3 at 28 x 28, 6 columns x 2 blocks (36),
    0.72 -> 0.63; a 5x5's kw 0.575 -> 0.558), depthwise 3x3 and 5x5 over 14 columns (31, 33) 10-25% (960
    channels at 7 x 7 6.6 -> 5.7 us, 672 at 14 x 14 5x5 32 -> 25 us). Above it LLVM keeps the inputs several
    taps share live and spills: the same 3x3 tile at stride 2 (41) 0.73 -> 0.83 ms, ResNeXt-50's 16-lane
    grouped 3x3 over 19 columns (41) 0.47 -> 0.64."""
    return vector_registers() * 9 // 8


@dataclasses.dataclass(frozen=True)
class Variant:
    """A default-schedule variant of the conv and GEMM rules (schedule/variants.py measures a few at compile
    time): whether weights may stream beyond L2 (streaming.py), the widest conv vector, the most partial
    sums a conv tile keeps in registers (also bounding its filter sets, rules/conv_tile._filter_set)."""

    stream: bool = True
    conv_max_lanes: int | None = None  # None: the target's (conv_max_lanes())
    conv_accumulator_lanes: int | None = None  # at most this many partial sums; None: the target's broadcast budget

    def max_lanes(self) -> int:
        return self.conv_max_lanes or conv_max_lanes()

    def accumulator_lanes(self) -> int:
        return self.conv_accumulator_lanes or conv_broadcast_accumulator_lanes()


VARIANT = contextvars.ContextVar("souffle_schedule_variant", default=Variant())
