"""An integer convolution in the form `vpdpbusd` reads (AVX512_VNNI: in each of 16 int32 lanes, four
products of a uint8 and an int8 value), as int8_gemm.py forms the GEMMs: the reduction over input channels
split in quads (c = 4 cq + q, q innermost), the input copied once into quads of channels per pixel
[N, C / 4, H, W, 4] (uint8: an int8 input shifted by 128, its zero point with it, which the compensation
absorbs), and the weight packed Wp[F / 16, C / 4, kh, kw, 16, 4]: the 16 output channels x 4 input
channels of one instruction are one 64-byte row, the four input channels of one pixel its broadcast 32
bits. A plain int32 convolution (the conv rule's int32 lanes, a vpmulld and an add per 16 products) did a
quarter of this work per instruction. The schedule is schedule/int8_conv.py. Where the target emulates the
instruction with vpmaddwd pairs (`split`: AVX2), the weight's blocks are int16 halves (dot_weights.py) and
the input quads int16 (dot_weights.LOW_HIGH), so the kernel's loop splits no byte; a pixel-lane conv's
quads stay uint8, split in the kernel (EVEN_ODD_PIXELS weights).

A 1 x 1 convolution runs with its lanes over output pixels instead (`pixel_lanes`): the input copied
as [N, C / 4, P, 4] (16 pixels x 4 channels, one 64-byte row, the instruction's a operand; P the H * W
output pixels padded with zeros up to whole 16-pixel vectors, where that adds at most PIXEL_PADDING; a
stride subsamples in the copy), the weight's four channels of one output channel broadcast, and the int32
sum [N, F, P] read back as the NCHW map by a reshape. Its register tile is then written back as whole
vectors along the NCHW rows: with channels in the lanes, the write-back transposed every sum into NCHW one
scalar at a time, and a 1 x 1 conv's short reduction (64 channels: 16 instructions per accumulator) left
it the larger part of the work (ResNet-50's stage-0 1 x 1 convs at 270-400 GOP/s against 1200 for its
3 x 3 convs).

Only dense 2-D convolutions (no groups) of NCHW maps whose output channels are a multiple of 16; input
channels that are not whole quads (an RGB stem's 3) get a channel of zero weights (the plain int32 form
ran ResNet-50's 7 x 7 stem at a tenth of the float32 conv's speed).
"""

from __future__ import annotations

import numpy as np
import tvm
import tvm_ffi
from tvm import te, tirx

from souffle_py.ir.exprs import substitute
from souffle_py.ir.graph import tensor_key
from souffle_py.ir.marks import LAYOUT_COPY
from souffle_py.schedule.budgets import pixel_panel_fits
from te_passes import dot_weights
from te_passes.int8_gemm import VNNI_DEPTH, WIDE_INPUT
from te_passes.int8_reads import add_param
from te_passes.quant import ACC

INT8_CONV = "souffle_int8_conv"  # TE attribute of an integer convolution: its VNNI lanes (1: the plain form)
INPUT_SHIFT = 128                 # int8 + 128 is the uint8 vpdpbusd reads
PIXEL_LANES = "souffle_int8_pixel_lanes"  # TE attribute of a VNNI conv whose lanes are output pixels
# the most padding pixels (a share of the map's) a pixel-lane conv computes in vain. 0.35 against 0.1 ran
# ResNet-50 int8 3.1% faster (A/B in one process, 2-core Emerald Rapids): its 7 x 7 maps (64 for 49, 31%)
# in pixel lanes, whose write-backs store whole vectors with the requantization and residual add, not
# element by element (1.0%), and its 14 x 14 ones at 1024 channels padded to an even 14 vectors (14%),
# whose tiles of 2 vectors then fit L1 (2.2%)
PIXEL_PADDING = 0.35


def vnni_conv(op, x_load, x_int, w_load, w_int8: np.ndarray, lanes: int, params, param_tensors, copies=None,
              split: bool = False, zero_point: int = 0, may_saturate=None):
    """(the int32 sum of `op`'s products in vpdpbusd's form, the shift added to the input's values) or None
    where the convolution is not a dense NCHW one of whole quads and vectors (module docstring). `copies`:
    the input quads made so far in this pass, by input (a block's first conv and its downsampling conv read
    the same map: one copy, not two that the horizontal pass then stacks). `split`: the weight packed in
    int16 halves and the input quads widened to int16 (module docstring), unless dot_weights.pair_form keeps
    them whole (`zero_point`: the input's, before the shift; `may_saturate`)."""
    if len(op.axis) != 4 or len(op.reduce_axis) != 3 or w_int8.ndim != 4:
        return None
    filters, channels = w_int8.shape[:2]
    reduce_vars = [iv.var for iv in op.reduce_axis]
    x_args, w_args = list(x_load.args[1:]), list(w_load.args[1:])
    if len(x_args) != 4 or len(w_args) != 5 or filters % lanes:
        return None
    rc = x_args[1]
    if not (isinstance(rc, tirx.Var) and rc.same_as(w_args[1]) and any(rc.same_as(v) for v in reduce_vars)):
        return None  # grouped (the channel read is offset by the group) or another layout
    taps = w_args[2:4]
    if not all(isinstance(t, tirx.Var) and any(t.same_as(v) for v in reduce_vars) for t in taps):
        return None
    if str(x_int.dtype) not in ("int8", "uint8") or int(x_int.shape[1]) != channels:
        return None
    shift = INPUT_SHIFT if str(x_int.dtype) == "int8" else 0
    n, _, height, width = (int(d) for d in x_int.shape)
    source = x_int
    whole = -(-channels // VNNI_DEPTH) * VNNI_DEPTH  # an RGB stem's 3 channels and a fourth of zero weights

    def quad(b, cq, h, w, q, dtype="uint8"):
        c = cq * VNNI_DEPTH + q
        if whole == channels:  # whole quads, no clamp: a plain index, which rules/layout_copy.py maps back
            return (source[b, c, h, w].astype(ACC) + shift).astype(dtype)
        value = (source[b, tirx.min(c, channels - 1), h, w].astype(ACC) + shift).astype(dtype)
        return tirx.if_then_else(c < channels, value, tirx.const(0, dtype))

    copies = {} if copies is None else copies
    kh, kw = w_int8.shape[2:]
    axes = [iv.var for iv in op.axis]
    shape = [int(d) for d in op.output(0).shape]
    point = _input_point(x_args, taps, axes) if kh == kw == 1 else None
    pixels = point is not None and bool(_padded_pixels(shape[2] * shape[3], lanes, whole // VNNI_DEPTH))
    blocks = _weight_blocks(w_int8, whole, lanes)
    split, marks = dot_weights.pair_form(split, blocks, zero_point + shift, may_saturate)
    layout = dot_weights.PLAIN if not split else dot_weights.EVEN_ODD_PIXELS if pixels else dot_weights.LOW_HIGH
    w_t = add_param(params, param_tensors, dot_weights.pack(blocks, layout), f"{op.name}_weight_vnni")
    weight = lambda f, cq, r, s, q: dot_weights.read(w_t, [f // lanes, cq, r, s], f % lanes, q, layout)  # noqa: E731
    if pixels:
        return pixel_lanes(op, (x_int, quad, point), (n, whole, shape), weight, lanes, copies, marks), shift
    dtype = "int16" if split else "uint8"  # split: widened once here (dot_weights.LOW_HIGH)
    key = (tensor_key(x_int), whole, dtype)
    if key not in copies:
        copies[key] = te.compute((n, whole // VNNI_DEPTH, height, width, VNNI_DEPTH),
                                 lambda b, cq, h, w, q: quad(b, cq, h, w, q, dtype), name=f"{op.name}_input_quads",
                                 attrs={LAYOUT_COPY: 1})
    quads = copies[key]
    cq = te.reduce_axis((0, whole // VNNI_DEPTH), name="cq")
    r, s = te.reduce_axis((0, kh), name="r"), te.reduce_axis((0, kw), name="s")
    q = te.reduce_axis((0, VNNI_DEPTH), name="q")

    def product(*idx):
        mapping = {v.__chandle__(): i for v, i in zip(axes, idx)}
        mapping[taps[0].__chandle__()], mapping[taps[1].__chandle__()] = r.var, s.var
        h, w = (substitute(e, mapping) for e in x_args[2:])
        f = idx[1]
        x = quads[idx[0], cq, h, w, q].astype(ACC)
        return te.sum(x * weight(f, cq, r, s, q).astype(ACC), axis=[cq, r, s, q])

    wide = {WIDE_INPUT: 1} if split else {}
    acc = te.compute(shape, product, name=f"{op.name}_acc", attrs={INT8_CONV: lanes, **wide, **marks})
    return acc, shift


def pixel_lanes(op, source, sizes, weight, lanes: int, copies: dict, marks=None) -> te.Tensor:
    """A 1 x 1 convolution's int32 sum with its lanes over output pixels (module docstring), as the NCHW
    map: the input quads [N, C / 4, P, 4] (shared by the convolutions that read the same map at the same
    stride), the sum [N, F, P] (P: the H * W output pixels, padded) and its reshape to [N, F, H, W].
    `weight`: (f, cq, r, s, q) -> the packed weight's load; `marks`: the sum's attributes beside its lanes'."""
    (x_int, quad, point), (n, whole, shape) = source, sizes
    real, width = shape[2] * shape[3], shape[3]
    pixels = _padded_pixels(real, lanes, whole // VNNI_DEPTH)
    key = (tensor_key(x_int), whole, "pixels", str(point(tirx.Var("h", "int32"), tirx.Var("w", "int32"))))
    if key not in copies:
        def flat(b, cq, p, q):
            if pixels == real:
                return quad(b, cq, *point(p // width, p % width), q)
            value = quad(b, cq, *point(tirx.min(p, real - 1) // width, tirx.min(p, real - 1) % width), q)
            return tirx.if_then_else(p < real, value, tirx.const(0, "uint8"))
        copies[key] = te.compute((n, whole // VNNI_DEPTH, pixels, VNNI_DEPTH), flat,
                                 name=f"{op.name}_input_pixel_quads", attrs={LAYOUT_COPY: 1})
    quads = copies[key]
    cq = te.reduce_axis((0, whole // VNNI_DEPTH), name="cq")
    q = te.reduce_axis((0, VNNI_DEPTH), name="q")

    def product(b, f, p):
        x = quads[b, cq, p, q].astype(ACC)
        return te.sum(x * weight(f, cq, 0, 0, q).astype(ACC), axis=[cq, q])
    acc = te.compute([n, shape[1], pixels], product, name=f"{op.name}_acc_pixels",
                     attrs={INT8_CONV: lanes, PIXEL_LANES: 1, **(marks or {})})
    return te.compute(shape, lambda b, f, h, w: acc[b, f, h * width + w], name=f"{op.name}_acc")


def _weight_blocks(w_int8: np.ndarray, whole: int, lanes: int) -> np.ndarray:
    """W[F, C, kh, kw] as Wp[F / lanes, C / 4, kh, kw, lanes, 4], input channels zero-padded to `whole`."""
    filters, channels, kh, kw = w_int8.shape
    padded = np.zeros((filters, whole, kh, kw), np.int8)
    padded[:, :channels] = w_int8
    packed = padded.reshape(filters // lanes, lanes, whole // VNNI_DEPTH, VNNI_DEPTH, kh, kw) \
        .transpose(0, 2, 4, 5, 1, 3)
    return packed


def _padded_pixels(pixels: int, lanes: int, depth_quads: int) -> int:
    """The map's pixels padded up to whole vectors (0 where the padding would exceed PIXEL_PADDING of them):
    ResNet's 14 x 14 maps run 208 pixels (6% more; 224 where no tile fits, below), its 7 x 7 ones 64 for
    49; 3 x 3 maps (16 for 9) keep their channels in the lanes.
    Where no tile of two vectors or more divides the count with its input panel in L1 (budgets.
    pixel_panel_fits), an odd count becomes even if that stays within PIXEL_PADDING: 28 x 28's 49 vectors
    divide only into tiles of 7, a panel of 56 KiB at 512 input channels; 50 allow 2 (ResNet-50's four such
    convs 1.35 -> 0.92 ms, A/B). A panel that fits keeps the map unpadded: a padded map's requantizing
    reader (a residual add) stays a pass of its own (schedule/int8_pixel_conv.py)."""
    padded = -(-pixels // lanes) * lanes
    if padded - pixels > PIXEL_PADDING * pixels:
        return 0
    vectors = padded // lanes
    if vectors < 2 or any(vectors % v == 0 and pixel_panel_fits(v, depth_quads, lanes) for v in range(2, vectors + 1)):
        return padded
    even = -(-pixels // (2 * lanes)) * 2 * lanes
    return even if even - pixels <= PIXEL_PADDING * pixels else padded


def _input_point(x_args, taps, axes):
    """(h, w) -> the input point a 1 x 1 convolution reads for output pixel (h, w), where that is a plain
    stride (h * sh, w * sw: no padding, no offset), else None. A strided convolution's quads are a copy of
    its own, subsampled (ResNet's downsampling convs)."""
    at_tap = {t.__chandle__(): tirx.const(0, "int32") for t in taps}
    analyzer = tvm.sym.Analyzer()
    reads = [analyzer.simplify(substitute(e, at_tap)) for e in x_args[2:]]
    strides = []
    for read, axis in zip(reads, axes[2:]):
        step = analyzer.simplify(substitute(read, {axis.__chandle__(): tirx.const(1, "int32")})
                                 - substitute(read, {axis.__chandle__(): tirx.const(0, "int32")}))
        if not isinstance(step, tirx.IntImm) or step.value < 1 or not tvm_ffi.structural_equal(
                analyzer.simplify(read - axis * step.value), tirx.const(0, "int32")):
            return None
        strides.append(int(step.value))
    return lambda h, w: (h * strides[0], w * strides[1])
