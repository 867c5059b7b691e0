"""Matrix products and normalizations: MatMul, Gemm, LayerNormalization."""

from __future__ import annotations

from tvm import te, tirx

from souffle_py.frontend.context import register
from souffle_py.frontend.ops.reduce import reduce
from souffle_py.frontend.ops.util import dtype_of, broadcast_indices, broadcast_shape, elementwise, shape_of


def matmul(a: te.Tensor, b: te.Tensor, name: str = "matmul") -> te.Tensor:
    """numpy.matmul semantics: batch dims broadcast, 1-D operands promoted and their axis dropped."""
    sa, sb = shape_of(a), shape_of(b)
    a_vec, b_vec = len(sa) == 1, len(sb) == 1
    m, k = (1, sa[0]) if a_vec else sa[-2:]
    k2, n = (sb[0], 1) if b_vec else sb[-2:]
    if k != k2:
        raise ValueError(f"inner dimensions differ: {list(sa)} @ {list(sb)}")
    batch = broadcast_shape(sa[:-2], sb[:-2])
    out_shape = list(batch) + ([] if a_vec else [m]) + ([] if b_vec else [n])
    r = te.reduce_axis((0, k), name="k")

    def body(*idx):
        idx = list(idx)
        bidx = idx[:len(batch)]
        rest = idx[len(batch):]
        i = None if a_vec else rest.pop(0)
        j = None if b_vec else rest.pop(0)
        a_idx = [r] if a_vec else broadcast_indices(bidx, sa[:-2]) + [i, r]
        b_idx = [r] if b_vec else broadcast_indices(bidx, sb[:-2]) + [r, j]
        return te.sum(a(*a_idx) * b(*b_idx), axis=r)

    return te.compute(tuple(out_shape), body, name=name)


@register("MatMul")
def lower_matmul(ctx):
    a, b = ctx.tensor(0), ctx.tensor(1)
    if dtype_of(a) != dtype_of(b):
        raise ctx.unsupported(f"operands have different dtypes ({dtype_of(a)}, {dtype_of(b)})")
    try:
        return [matmul(a, b)]
    except ValueError as exc:
        raise ctx.unsupported(str(exc)) from None


@register("Gemm", attributes=["alpha", "beta", "transA", "transB", "broadcast"])  # broadcast: opsets < 7
def lower_gemm(ctx):
    """Y = alpha * A' @ B' + beta * C, as a GEMM TE plus an epilogue TE when alpha/C are present."""
    a, b = ctx.tensor(0), ctx.tensor(1)
    if a.ndim != 2 or b.ndim != 2:
        raise ctx.unsupported(f"A and B must be 2-D, got {list(shape_of(a))} and {list(shape_of(b))}")
    trans_a, trans_b = ctx.attr("transA", 0), ctx.attr("transB", 0)
    m, k = shape_of(a)[::-1] if trans_a else shape_of(a)
    k2, n = shape_of(b)[::-1] if trans_b else shape_of(b)
    if k != k2:
        raise ctx.unsupported(f"inner dimensions differ: A' is {m}x{k}, B' is {k2}x{n}")
    r = te.reduce_axis((0, k), name="k")
    product = te.compute((m, n), lambda i, j: te.sum((a[r, i] if trans_a else a[i, r]) *
                                                       (b[j, r] if trans_b else b[r, j]), axis=r), name="gemm")
    alpha, beta = float(ctx.attr("alpha", 1.0)), float(ctx.attr("beta", 1.0))
    inputs = [product]
    if ctx.has(2) and beta != 0.0:
        inputs.append(ctx.tensor(2))
    if alpha == 1.0 and len(inputs) == 1:
        return [product]

    def epilogue(p, c=None):
        out = p if alpha == 1.0 else p * tirx.const(alpha, dtype_of(p))
        if c is not None:
            out = out + (c if beta == 1.0 else c * tirx.const(beta, dtype_of(c)))
        return out

    return [elementwise(inputs, (m, n), epilogue, "gemm_epilogue")]


@register("LayerNormalization", attributes=["axis", "epsilon", "stash_type"])
def lower_layer_norm(ctx):
    """(x - mean) / sqrt(var + eps) * gamma + beta over the trailing axes from `axis` on."""
    x, gamma = ctx.tensor(0), ctx.tensor(1)
    if ctx.attr("stash_type", 1) != 1:
        raise ctx.unsupported("only stash_type=1 (float32 statistics) is supported")
    axis = ctx.axis(ctx.attr("axis", -1), x.ndim)
    eps = tirx.const(float(ctx.attr("epsilon", 1e-5)), dtype_of(x))
    axes = list(range(axis, x.ndim))
    count = 1
    for a in axes:
        count *= shape_of(x)[a]
    inv = tirx.const(1.0 / count, dtype_of(x))
    keep = lambda idx: [0 if i in axes else v for i, v in enumerate(idx)]  # noqa: E731
    mean = reduce(x, axes, True, "sum", "mean", lambda v, idx: v * inv)
    var = reduce(x, axes, True, "sum", "var",
                 lambda v, idx: (v - mean(*keep(idx))) * (v - mean(*keep(idx))) * inv)
    inv_std = te.compute(var.shape, lambda *idx: tirx.const(1.0, dtype_of(x)) / tirx.sqrt(var(*idx) + eps),
                         name="inv_std")
    params = [gamma] + ([ctx.tensor(2)] if ctx.has(2) else [])

    def normalize(*idx):
        idx = list(idx)
        y = (x(*idx) - mean(*keep(idx))) * inv_std(*keep(idx))
        tail = idx[axis:]
        y = y * gamma(*broadcast_indices(tail, shape_of(gamma)))
        if len(params) == 2:
            y = y + params[1](*broadcast_indices(tail, shape_of(params[1])))
        return y

    out = te.compute(x.shape, normalize, name="layer_norm")
    return [out, mean, inv_std]
