"""The packed weight's layout within one dot-product instruction (schedule/int8_dot.py), its L lanes x 4
depths: as `vpdpbusd` reads them, or split once here into the int16 pairs that the `vpmaddwd` emulation
multiplies (AVX2, AVX512BW without VNNI), so the micro-kernel does not split them in its loop. Each
vpmaddwd multiplies one half of the pairs: the activations' even and odd bytes where the kernel splits
their quads (and, shift right: the pixel-lane convs), their first and second pairs where they were widened
to int16 in memory (the GEMMs and the convs with channels in the lanes).

- PLAIN: [L, 4] int8 (vpdpbusd, and the saturating vpmaddubsw form);
- EVEN_ODD_PIXELS: [L, 2, 2], [i, h, t] = depth 2t + h (lanes over pixels, int8_conv_vnni.pixel_lanes: one
  output channel's quad, each half a 32-bit pair to broadcast);
- LOW_HIGH: [2, L, 2], [h, i, t] = depth 2h + t (lanes over output channels, activations widened to int16
  in memory: each half pairs with one 32-bit pair of the activations' quad).

The packers (int8_gemm.py, int8_conv_vnni.py) pack [..., L, 4] blocks with `pack` and read them with `read`.

Weights whose adjacent depths cannot make `vpmaddubsw` saturate (`pairs_bounded`: ONNX Runtime's
`reduce_range` weights, 7 bits, always) stay PLAIN on the split targets too, their TE marked NARROW_PAIRS:
the micro-kernel then takes the saturating form (schedule/int8_dot.py), exact for them, 1.3x faster.
Under `optimize(int8="saturating")` a stage takes it too where its activations' uint8 zero point is low
(or set at run time) - `may_saturate`, schedule/int8_dot.saturation_allowed - marked SATURATING_PAIRS:
`pair_form` decides, per stage. A stage left split is marked with its activations' zero point
(SPLIT_ZERO_POINT), from which the plan says what int8="saturating" would change (int8_dot.int8_notes).
"""

from __future__ import annotations

import numpy as np

PLAIN, EVEN_ODD_PIXELS, LOW_HIGH = "plain", "even_odd_pixels", "low_high"
NARROW_PAIRS = "souffle_int8_narrow_pairs"  # TE attribute: a dot-product stage whose weights are pairs_bounded
SATURATING_PAIRS = "souffle_int8_saturating_pairs"  # TE attribute: a stage int8="saturating" let saturate
SPLIT_ZERO_POINT = "souffle_int8_split_zero_point"  # TE attribute of a split stage: its activations' uint8 zero
# point (-1: set at run time)
RUN_TIME = -1
PAIR_BOUND = 128  # |w0| + |w1| at most this: 255 x 128 = 32640 fits vpmaddubsw's int16 (at most 32767)


def pairs_bounded(blocks: np.ndarray) -> bool:
    """Whether no lane of `blocks` [..., 4] (int8) has two adjacent depths (2t, 2t + 1, the pair one
    vpmaddubsw sums into an int16) whose magnitudes sum above PAIR_BOUND: then no uint8 activations can
    saturate that sum, and the saturating form is exact (module docstring)."""
    magnitudes = np.abs(np.asarray(blocks, np.int16))
    return bool((magnitudes[..., 0::2] + magnitudes[..., 1::2]).max(initial=0) <= PAIR_BOUND)


def pair_form(split: bool, blocks: np.ndarray, zero_point: int | None, may_saturate=None) -> tuple[bool, dict]:
    """(whether the stage's operands are split, its TE marks) for a dot-product stage with weight `blocks`
    and activations of uint8 zero point `zero_point` (None: set at run time), on a target whose exact form
    splits them (`split`): the vpmaddubsw form (PLAIN, not split) where the weights cannot saturate it
    (NARROW_PAIRS) or `may_saturate(zero_point)` lets it saturate (SATURATING_PAIRS), else the split
    (SPLIT_ZERO_POINT: the zero point)."""
    if not split:
        return False, {}
    if pairs_bounded(blocks):
        return False, {NARROW_PAIRS: 1}
    if may_saturate is not None and may_saturate(zero_point):
        return False, {SATURATING_PAIRS: 1}
    return True, {SPLIT_ZERO_POINT: RUN_TIME if zero_point is None else int(zero_point)}


def pack(blocks: np.ndarray, layout: str) -> np.ndarray:
    """`blocks` [..., L, 4] int8 in `layout` (module docstring), contiguous."""
    if layout == PLAIN:
        return np.ascontiguousarray(blocks)
    *outer, lanes, depth = blocks.shape
    words = blocks.astype(np.int16).reshape(*outer, lanes, 2, 2)  # [..., i, d // 2, d % 2]
    rank, first = words.ndim, words.ndim - 3
    order = {EVEN_ODD_PIXELS: (first, rank - 1, rank - 2), LOW_HIGH: (rank - 2, first, rank - 1)}[layout]
    return np.ascontiguousarray(words.transpose(*range(first), *order))


def read(weight, outer: list, lane, depth, layout: str):
    """The TE load of the value at (`lane`, `depth` in [0, 4)) of the block at `outer` of a weight packed by
    `pack` in `layout`."""
    if layout == PLAIN:
        return weight[(*outer, lane, depth)]
    if layout == EVEN_ODD_PIXELS:
        return weight[(*outer, lane, depth % 2, depth // 2)]
    return weight[(*outer, depth // 2, lane, depth % 2)]
