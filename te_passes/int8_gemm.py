"""Integer GEMMs from QDQ chains: a float32 GEMM whose operands are both DequantizeLinear TEs, the weight a
constant int8 matrix, becomes an int8 x int8 GEMM summed in int32, with the zero points compensated and
the scales applied once to the sum:

    sum_k (a - za) sa (w[k, j] - zw[j]) sw[j]
        = sa sw[j] (sum_k a w[k, j]  -  za colsum_w[j] + K za zw[j]  -  zw[j] rowsum_a)

colsum_w and the constant terms are computed here, at compile time, into one int32 vector per column;
rowsum_a (a TE) only where a weight zero point is not 0 (ONNX Runtime's int8 weights are symmetric: zw = 0).
The activation's scale and zero point must be per tensor, the weight's per tensor or per column. This is
what ONNX Runtime does with a QDQ model (its QDQ fusions make QLinearMatMul / MatMulIntegerToFloat), so the
values that follow match its integer kernels instead of a float32 GEMM of dequantized values (which rounds
each product). The integer GEMM is marked INT8_GEMM for the schedule.

On a target with AVX512_VNNI (`vnni_lanes`), the GEMM takes the form `vpdpbusd` reads (u8 x s8, four
products per int32 lane): int8 activations shifted by 128 into uint8 (their zero point with them, so the
compensation absorbs the shift), uint8 weights shifted by -128 into int8, and the weight packed once
Wp[N / 16, K / 4, 16, 4], one 64-byte row per instruction (schedule/int8_gemm.py). Where the target
emulates the instruction with vpmaddwd pairs (`split`: AVX2, 8 lanes), the weight's blocks are int16 halves
and the activation is widened to int16 quads in a copy of its own (`_activation`, dot_weights.py), so the
kernel's loop splits no byte; weights no pair of which can saturate vpmaddubsw (dot_weights.pairs_bounded:
ONNX Runtime's reduce_range) stay int8 quads, marked NARROW_PAIRS for the saturating form, exact for them,
as do, under int8="saturating", those dot_weights.pair_form lets saturate (SATURATING_PAIRS).
An activation whose depth is not its innermost index (a Gemm's transA) is copied with it last.
"""

from __future__ import annotations

import numpy as np
from tvm import te, tirx

from souffle_py.ir.exprs import substitute
from souffle_py.ir.graph import tensor_key
from souffle_py.ir.marks import LAYOUT_COPY
from te_passes import dot_weights
from te_passes.int8_reads import add_param, dequantized, is_load, product_reads
from te_passes.quant import ACC

SCALED = "souffle_int8_scaled"  # TE attribute of an integer kernel's scaled sum: its channel axis (int8_requant.py)
INT8_GEMM = "souffle_int8_gemm"  # TE attribute of an integer GEMM this pass formed: its VNNI lanes (0: plain)
VNNI_DEPTH = 4  # int8 products per int32 lane that one vpdpbusd sums (an ISA fact)
WIDE_INPUT = "souffle_int8_wide_input"  # TE attribute of an integer GEMM or conv whose input quads are int16


def integer_gemm(program, op, params, param_tensors, vnni_lanes: int = 0, split: bool = False,
                 copies: dict | None = None, may_saturate=None) -> te.ComputeOp | None:
    """The integer GEMM replacing `op` (its output, element for element), or None where it does not apply.
    `vnni_lanes` (16 where the target has AVX512_VNNI, else 0): the VNNI form where the shape allows, its
    operands split into int16 halves where `split` (`_activation`, dot_weights.py) unless
    dot_weights.pair_form keeps them whole (`may_saturate`), its widened input shared through `copies`."""
    found = product_reads(op)
    if found is None or len(op.reduce_axis) != 1:
        return None
    _, loads = found
    k_var, j_var = op.reduce_axis[0].var, op.axis[-1].var
    reads = [dequantized(program, load) for load in loads]
    if any(r is None for r in reads):
        return None
    weight = next((r for r in reads if r.source.op.name in program.params and r.source.ndim == 2), None)
    act = next((r for r in reads if r is not weight), None)
    if weight is None or act is None or act.zero.size != 1 or act.scale.size != 1:
        return None
    k_axis = next((a for a, e in enumerate(weight.indices) if _is_var(e, k_var)), None)
    j_axis = 1 - k_axis if k_axis is not None else None
    if k_axis is None or not _is_var(weight.indices[j_axis], j_var):
        return None
    if (weight.zero.size > 1 or weight.scale.size > 1) and weight.axis != j_axis:
        return None  # per-axis along k: the scale does not factor out of the sum
    w = np.asarray(program.params[weight.source.op.name])
    w = w if k_axis == 0 else w.T  # [K, N]
    k_extent, n = w.shape
    za = int(act.zero.reshape(-1)[0])
    zw = np.broadcast_to(weight.zero.reshape(-1).astype(np.int64), (n,))
    base = op.name
    axes = [iv.var for iv in op.axis]

    def at(expr, idx, k):
        mapping = {v.__chandle__(): i for v, i in zip(axes, idx)}
        mapping[k_var.__chandle__()] = k
        return substitute(expr, mapping)

    act_read = lambda idx, k: act.source(*[at(e, idx, k) for e in act.indices])  # noqa: E731
    fits = bool(vnni_lanes) and k_extent % VNNI_DEPTH == 0 and n % vnni_lanes == 0
    w_s8 = (w.astype(np.int64) - 128).astype(np.int8) if w.dtype == np.uint8 else w
    shifted_zero = za + _shift(act.source)  # the uint8 activations' zero point
    split, marks = dot_weights.pair_form(split, _blocks(w_s8, vnni_lanes), shifted_zero, may_saturate) if fits \
        else (split, {})
    activation = _activation(act.source, act.indices, k_var, split, base, copies) if fits else None
    vnni = activation is not None
    layout = dot_weights.PLAIN
    if vnni:
        # u8 x s8, as vpdpbusd takes them: s8 activations shifted by 128 (their zero point with them), u8
        # weights shifted by -128 (theirs too); the weight packed [N / L, K / 4, L, 4]
        operand, shift, layout = activation
        act_read = lambda idx, k: operand([at(e, idx, k) for e in act.indices])  # noqa: E731
        za += shift
        if w.dtype == np.uint8:
            w, zw = w_s8, zw - 128
        w_t = add_param(params, param_tensors, _packed(w, vnni_lanes, layout), f"{base}_weight_vnni")
        w_read = lambda idx, k: _read(w_t, idx[-1], k, vnni_lanes, layout)  # noqa: E731
    else:
        w_read = lambda idx, k: weight.source(*[at(e, idx, k) for e in weight.indices])  # noqa: E731
    colsum = w.astype(np.int64).sum(axis=0)
    corr = (-za * colsum + k_extent * za * zw).astype(np.int32)
    scale = (np.float32(act.scale.reshape(-1)[0]) * np.broadcast_to(weight.scale.reshape(-1), (n,))).astype(np.float32)
    corr_t = add_param(params, param_tensors, corr, f"{base}_zero_points")
    scale_t = add_param(params, param_tensors, scale, f"{base}_scales")
    r = te.reduce_axis((0, k_extent), name="k")
    shape = [int(d) for d in op.output(0).shape]
    acc = te.compute(shape, lambda *idx: te.sum(act_read(idx, r.var).astype(ACC) * w_read(idx, r.var).astype(ACC),
                                                axis=r), name=f"{base}_acc",
                     attrs={INT8_GEMM: vnni_lanes if vnni else 0, **_wide(layout), **(marks if vnni else {})})
    rowsum = None
    if np.any(zw != 0):
        zw_t = add_param(params, param_tensors, zw.astype(np.int32), f"{base}_weight_zero_points")
        r2 = te.reduce_axis((0, k_extent), name="k")
        rowsum = te.compute(shape[:-1] + [1], lambda *idx: te.sum(act_read(idx, r2.var).astype(ACC), axis=r2),
                            name=f"{base}_row_sums")

    def finish(*idx):
        total = acc(*idx) + corr_t(idx[-1])
        if rowsum is not None:
            total = total - zw_t(idx[-1]) * rowsum(*idx[:-1], 0)
        return total.astype("float32") * scale_t(idx[-1])

    return te.compute(shape, finish, name=base, attrs={SCALED: len(shape) - 1}).op


def _is_var(expr, var) -> bool:
    return isinstance(expr, tirx.Var) and expr.same_as(var)


def _activation(source: te.Tensor, indices, k_var, split: bool, base: str, copies: dict | None = None):
    """(read, shift, weight layout): the activation `source` (read at `indices`) as the dot product takes
    it, read(indices) its load, or None where k is no index of its own (the caller keeps the plain int32
    form). uint8: int8 shifted by `shift` (128; the caller compensates). The dot product reads 4
    consecutive depths: where k is not `source`'s innermost index (a Gemm's transA), a layout copy with k
    last. Where the target's dot product splits its operands (`split`, dot_weights.py), widened to int16
    quads [..., K / 4, 4] once, in a layout copy of its own (the kernel then broadcasts two 32-bit pairs
    per quad and splits nothing: weights LOW_HIGH). `copies`: the widened inputs made so far, by source
    (the GEMMs that read one activation, BERT's Q, K and V, read one copy, and the horizontal pass can
    stack them)."""
    shift = _shift(source)
    position = next((p for p, e in enumerate(indices) if _is_var(e, k_var)), None)
    if position is None:
        return None
    order = [d for d in range(len(indices)) if d != position] + [position]  # source's axes, k last
    moved = order != list(range(len(order)))
    shape = [int(source.shape[d]) for d in order]
    original = source
    value = lambda i: original(*[i[order.index(d)] for d in range(len(order))])  # noqa: E731  (k-last index)
    permuted = lambda ix: [ix[d] for d in order]  # noqa: E731
    if split:
        copies = {} if copies is None else copies
        key = (tensor_key(source), "int16 quads") + ((tuple(order),) if moved else ())
        if key not in copies:
            copies[key] = te.compute(
                shape[:-1] + [shape[-1] // VNNI_DEPTH, VNNI_DEPTH],
                lambda *i: (value([*i[:-2], i[-2] * VNNI_DEPTH + i[-1]]).astype(ACC) + shift).astype("int16"),
                name=f"{base}_input_quads", attrs={LAYOUT_COPY: 1})
        quads = copies[key]

        def wide_read(ix):
            *rows, k = permuted(ix)
            return quads(*rows, k // VNNI_DEPTH, k % VNNI_DEPTH)
        return wide_read, shift, dot_weights.LOW_HIGH
    if shift or moved:
        source = te.compute(shape, lambda *i: (value(i).astype(ACC) + shift).astype("uint8"), name=f"{base}_u8",
                            attrs={LAYOUT_COPY: 1} if moved else {})
    return (lambda ix: source(*permuted(ix))), shift, dot_weights.PLAIN


def _shift(source: te.Tensor) -> int:
    """What the dot product's uint8 operand adds to `source`'s values: 128 for int8, 0 for uint8."""
    return 128 if str(source.dtype) == "int8" else 0


def _wide(layout: str) -> dict:
    """The WIDE_INPUT mark of a GEMM whose weight is in `layout` (none where its input is not widened)."""
    return {WIDE_INPUT: 1} if layout == dot_weights.LOW_HIGH else {}


def _blocks(w: np.ndarray, lanes: int) -> np.ndarray:
    """W[K, N] as [N / L, K / 4, L, 4] blocks."""
    k_extent, n = w.shape
    return w.reshape(k_extent // VNNI_DEPTH, VNNI_DEPTH, n // lanes, lanes).transpose(2, 0, 3, 1)


def _packed(w: np.ndarray, lanes: int, layout: str) -> np.ndarray:
    """W[K, N] packed [N / L, K / 4, (L, 4) in `layout`: dot_weights.py]."""
    return dot_weights.pack(_blocks(w, lanes), layout)


def _read(w_t, j, k, lanes: int, layout: str):
    return dot_weights.read(w_t, [j // lanes, k // VNNI_DEPTH], j % lanes, k % VNNI_DEPTH, layout)


def vnni_form(program, op, params, param_tensors, vnni_lanes: int, split: bool = False,
              copies: dict | None = None, may_saturate=None) -> te.ComputeOp | None:
    """A plain integer GEMM (INT8_GEMM 0: the frontend's MatMulInteger / QLinearMatMul of a constant
    int8 weight, sum_k int32(a[.., i, k]) * int32(w[k, j])) in vpdpbusd's form, element for element:
    uint8 activations (int8 ones shifted by 128, the shift's 128 colsum_w[j] taken off after), the weight
    packed [N / 16, K / 4, 16, 4]; None where the shape or the operands do not fit. Its activations' zero
    point is the frontend's business (a DynamicQuantizeLinear's is set at run time): `may_saturate(None)`."""
    if not vnni_lanes or INT8_GEMM not in (op.attrs or {}) or int(op.attrs[INT8_GEMM]) != 0:
        return None
    if len(op.reduce_axis) != 1 or len(op.body) != 1:
        return None
    source = op.body[0].source[0]
    try:
        a_load, w_load = source.a.value, source.b.value
    except AttributeError:
        return None
    k_var, j_var = op.reduce_axis[0].var, op.axis[-1].var
    weight = w_load.args[0]
    if not (is_load(a_load) and is_load(w_load) and weight.op.name in program.params and weight.ndim == 2
            and _is_var(w_load.args[1], k_var) and _is_var(w_load.args[2], j_var)):
        return None
    w = np.asarray(program.params[weight.op.name])
    k_extent, n = w.shape
    act = a_load.args[0]
    if w.dtype != np.int8 or str(act.dtype) not in ("int8", "uint8") or k_extent % VNNI_DEPTH or n % vnni_lanes:
        return None
    axes = [iv.var for iv in op.axis]
    base = op.name
    split, marks = dot_weights.pair_form(split, _blocks(w, vnni_lanes), None, may_saturate)
    activation = _activation(act, a_load.args[1:], k_var, split, base, copies)
    if activation is None:
        return None
    operand, shifted, layout = activation
    shift = shifted * w.astype(np.int64).sum(axis=0)
    w_t = add_param(params, param_tensors, _packed(w, vnni_lanes, layout), f"{base}_weight_vnni")
    shift_t = add_param(params, param_tensors, shift.astype(np.int32), f"{base}_shift")
    r = te.reduce_axis((0, k_extent), name="k")

    def product(*idx):
        mapping = {v.__chandle__(): i for v, i in zip(axes, idx)}
        mapping[k_var.__chandle__()] = r.var
        a_read = operand([substitute(e, mapping) for e in a_load.args[1:]])
        j = idx[-1]
        w_read = _read(w_t, j, r.var, vnni_lanes, layout)
        return te.sum(a_read.astype(ACC) * w_read.astype(ACC), axis=r)

    shape = [int(d) for d in op.output(0).shape]
    acc = te.compute(shape, product, name=f"{base}_vnni", attrs={INT8_GEMM: vnni_lanes, **_wide(layout), **marks})
    return te.compute(shape, lambda *idx: acc(*idx) - shift_t(idx[-1]), name=base).op
