"""An integer convolution in the form `vpdpbusd` reads (AVX512_VNNI: in each of 16 int32 lanes, four
products of a uint8 and an int8 value), as int8_gemm.py forms the GEMMs: the reduction over input channels
split in quads (c = 4 cq + q, q innermost), the input copied once into quads of channels per pixel
[N, C / 4, H, W, 4] (uint8: an int8 input shifted by 128, its zero point with it, which the compensation
absorbs), and the weight packed Wp[F / 16, C / 4, kh, kw, 16, 4]: the 16 output channels x 4 input
channels of one instruction are one 64-byte row, the four input channels of one pixel its broadcast 32
bits. A plain int32 convolution (the conv rule's int32 lanes, a vpmulld and an add per 16 products) did a
quarter of this work per instruction. The schedule is schedule/int8_conv.py.

Only dense 2-D convolutions (no groups) of NCHW maps whose output channels are a multiple of 16; input
channels that are not whole quads (an RGB stem's 3) get a channel of zero weights (the plain int32 form
ran ResNet-50's 7 x 7 stem at a tenth of the float32 conv's speed).
"""

from __future__ import annotations

import numpy as np
from tvm import te, tirx

from souffle_py.ir.exprs import substitute
from souffle_py.ir.graph import tensor_key
from souffle_py.ir.marks import LAYOUT_COPY
from te_passes.int8_gemm import VNNI_DEPTH
from te_passes.int8_reads import add_param
from te_passes.quant import ACC

INT8_CONV = "souffle_int8_conv"  # TE attribute of an integer convolution: its VNNI lanes (1: the plain form)
INPUT_SHIFT = 128                 # int8 + 128 is the uint8 vpdpbusd reads


def vnni_conv(op, x_load, x_int, w_load, w_int8: np.ndarray, lanes: int, params, param_tensors, copies=None):
    """(the int32 sum of `op`'s products in vpdpbusd's form, the shift added to the input's values) or None
    where the convolution is not a dense NCHW one of whole quads and vectors (module docstring). `copies`:
    the input quads made so far in this pass, by input (a block's first conv and its downsampling conv read
    the same map: one copy, not two that the horizontal pass then stacks)."""
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

    def quad(b, cq, h, w, q):
        c = cq * VNNI_DEPTH + q
        value = (source[b, tirx.min(c, channels - 1), h, w].astype(ACC) + shift).astype("uint8")
        return value if whole == channels else tirx.if_then_else(c < channels, value, tirx.const(0, "uint8"))

    key = (tensor_key(x_int), whole)
    copies = {} if copies is None else copies
    if key not in copies:
        copies[key] = te.compute((n, whole // VNNI_DEPTH, height, width, VNNI_DEPTH), quad,
                                 name=f"{op.name}_input_quads", attrs={LAYOUT_COPY: 1})
    quads = copies[key]
    kh, kw = w_int8.shape[2:]
    padded = np.zeros((filters, whole, kh, kw), np.int8)
    padded[:, :channels] = w_int8
    packed = padded.reshape(filters // lanes, lanes, whole // VNNI_DEPTH, VNNI_DEPTH, kh, kw) \
        .transpose(0, 2, 4, 5, 1, 3)
    w_t = add_param(params, param_tensors, np.ascontiguousarray(packed), f"{op.name}_weight_vnni")
    cq = te.reduce_axis((0, whole // VNNI_DEPTH), name="cq")
    r, s = te.reduce_axis((0, kh), name="r"), te.reduce_axis((0, kw), name="s")
    q = te.reduce_axis((0, VNNI_DEPTH), name="q")
    axes = [iv.var for iv in op.axis]

    def product(*idx):
        mapping = {v.__chandle__(): i for v, i in zip(axes, idx)}
        mapping[taps[0].__chandle__()], mapping[taps[1].__chandle__()] = r.var, s.var
        h, w = (substitute(e, mapping) for e in x_args[2:])
        f = idx[1]
        x = quads[idx[0], cq, h, w, q].astype(ACC)
        return te.sum(x * w_t[f // lanes, cq, r, s, f % lanes, q].astype(ACC), axis=[cq, r, s, q])

    shape = [int(d) for d in op.output(0).shape]
    acc = te.compute(shape, product, name=f"{op.name}_acc", attrs={INT8_CONV: lanes})
    return acc, shift
