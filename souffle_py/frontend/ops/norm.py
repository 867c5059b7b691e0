"""Normalizations: BatchNormalization (inference), InstanceNormalization, GroupNormalization, LRN,
LpNormalization, MeanVarianceNormalization and RMSNormalization.

Inference BatchNormalization is an affine map per channel; with constant statistics (every exported model)
its scale and shift are folded at compile time, so it costs one multiply-add TE.
"""

from __future__ import annotations

import numpy as np
from tvm import te, tirx

from souffle_py.frontend.context import register
from souffle_py.frontend.ops.reduce import reduce
from souffle_py.frontend.ops.util import dtype_of, shape_of


def channel_affine(x: te.Tensor, scale: te.Tensor, shift: te.Tensor, name: str) -> te.Tensor:
    """x * scale[c] + shift[c] with c the second axis."""
    return te.compute(x.shape, lambda n, c, *rest: x(n, c, *rest) * scale(c) + shift(c), name=name)


@register("BatchNormalization", attributes=["epsilon", "momentum", "training_mode", "is_test", "spatial"])
def lower_batch_norm(ctx):
    x = ctx.tensor(0)
    if ctx.attr("training_mode", 0) or (ctx.opset < 7 and not ctx.attr("is_test", 0)):
        raise ctx.unsupported("training mode (batch statistics) is not supported; inference only")
    if not ctx.attr("spatial", 1):
        raise ctx.unsupported("spatial=0 (per-activation statistics) is not supported")
    if any(o for o in ctx.node.output[1:]):
        raise ctx.unsupported("the running mean/variance outputs exist only in training mode")
    if x.ndim < 2:
        raise ctx.unsupported(f"input of rank {x.ndim}: BatchNormalization needs [N, C, ...]")
    channels = shape_of(x)[1]
    for i, what in enumerate(("scale", "bias", "mean", "var"), start=1):
        if ctx.shape(i) != (channels,):
            raise ctx.unsupported(f"{what} of shape {list(ctx.shape(i))} does not match {channels} channels")
    eps = float(ctx.attr("epsilon", 1e-5))
    dtype = dtype_of(x)
    if all(ctx.is_const(i) for i in range(1, 5)):
        gamma, beta, mean, var = (ctx.const(i).astype(np.float64) for i in range(1, 5))
        scale = gamma / np.sqrt(var + eps)
        base = ctx.node.input[0] or ctx.name
        return [channel_affine(x, ctx.new_param(scale.astype(dtype), f"{base}_bn_scale"),
                               ctx.new_param((beta - mean * scale).astype(dtype), f"{base}_bn_shift"), "batch_norm")]
    gamma, beta, mean, var = (ctx.tensor(i) for i in range(1, 5))
    eps_c = tirx.const(eps, dtype)
    return [te.compute(x.shape, lambda n, c, *rest: (x(n, c, *rest) - mean(c)) * gamma(c)
                       / tirx.sqrt(var(c) + eps_c) + beta(c), name="batch_norm")]


@register("InstanceNormalization", attributes=["epsilon"])
def lower_instance_norm(ctx):
    """(x - mean) / sqrt(var + eps) * scale[c] + bias[c], statistics over each instance's spatial axes."""
    x, gamma, beta = ctx.tensor(0), ctx.tensor(1), ctx.tensor(2)
    if x.ndim < 3:
        raise ctx.unsupported(f"input of rank {x.ndim}: InstanceNormalization needs [N, C, spatial...]")
    dtype = dtype_of(x)
    axes = list(range(2, x.ndim))
    inv = tirx.const(1.0 / int(np.prod(shape_of(x)[2:])), dtype)
    eps = tirx.const(float(ctx.attr("epsilon", 1e-5)), dtype)
    mean = reduce(x, axes, True, "sum", "mean", lambda v, idx: v * inv)
    stat = lambda idx: mean(*idx[:2], *[0] * len(axes))  # noqa: E731
    var = reduce(x, axes, True, "sum", "var", lambda v, idx: (v - stat(idx)) * (v - stat(idx)) * inv)

    def normalize(n, c, *rest):
        zeros = [0] * len(rest)
        return (x(n, c, *rest) - mean(n, c, *zeros)) / tirx.sqrt(var(n, c, *zeros) + eps) * gamma(c) + beta(c)

    return [te.compute(x.shape, normalize, name="instance_norm")]


@register("LRN", attributes=["alpha", "beta", "bias", "size"])
def lower_lrn(ctx):
    """x / (bias + alpha / size * sum of x^2 over `size` neighbouring channels) ^ beta (AlexNet, GoogLeNet)."""
    x = ctx.tensor(0)
    if x.ndim < 3 or not dtype_of(x).startswith("float"):
        raise ctx.unsupported(f"input of rank {x.ndim}, dtype {dtype_of(x)}: LRN needs float [N, C, ...]")
    dtype, size, channels = dtype_of(x), int(ctx.attr("size")), shape_of(x)[1]
    alpha, beta, bias = (float(ctx.attr(a, d)) for a, d in (("alpha", 1e-4), ("beta", 0.75), ("bias", 1.0)))
    lo = (size - 1) // 2
    r = te.reduce_axis((0, size), name="r")

    def square_sum(n, c, *rest):
        src = c - lo + r
        inside = tirx.all(src >= 0, src < channels)
        value = x(n, tirx.max(tirx.min(src, channels - 1), 0), *rest)
        return te.sum(tirx.Select(inside, value * value, tirx.const(0, dtype)), axis=r)

    sums = te.compute(x.shape, square_sum, name="lrn_square_sum")
    return [te.compute(x.shape, lambda *i: x(*i) / tirx.power(
        tirx.const(bias, dtype) + tirx.const(alpha / size, dtype) * sums(*i), tirx.const(beta, dtype)), name="lrn")]


def _stat_axes(ctx, x, axes):
    keep = lambda idx: [0 if i in axes else v for i, v in enumerate(idx)]  # noqa: E731
    count = int(np.prod([shape_of(x)[a] for a in axes]))
    return keep, tirx.const(1.0 / count, dtype_of(x))


@register("LpNormalization", attributes=["axis", "p"])
def lower_lp_normalization(ctx):
    x = ctx.tensor(0)
    axis, p = ctx.axis(ctx.attr("axis", -1), x.ndim), int(ctx.attr("p", 2))
    if p not in (1, 2) or not dtype_of(x).startswith("float"):
        raise ctx.unsupported(f"p={p} on {dtype_of(x)} (p 1 or 2 on floats)")
    norm = reduce(x, [axis], True, "sum", "norm", (lambda v, idx: tirx.abs(v)) if p == 1 else (lambda v, idx: v * v))
    keep = lambda idx: [0 if i == axis else v for i, v in enumerate(idx)]  # noqa: E731
    scale = (lambda n: n) if p == 1 else tirx.sqrt
    zero = tirx.const(0, dtype_of(x))
    return [te.compute(x.shape, lambda *i: tirx.Select(norm(*keep(i)) == zero, zero, x(*i) / scale(norm(*keep(i)))),
                       name="lp_normalization")]


@register("MeanVarianceNormalization", attributes=["axes"])
def lower_mvn(ctx):
    """(x - E[x]) / (sqrt(E[x^2] - E[x]^2) + 1e-9) over `axes` (default N, H, W), as ONNX's function says."""
    x = ctx.tensor(0)
    axes = sorted({ctx.axis(a, x.ndim) for a in ctx.attr("axes", [0, 2, 3])})
    keep, inv = _stat_axes(ctx, x, axes)
    mean = reduce(x, axes, True, "sum", "mean", lambda v, idx: v * inv)
    square = reduce(x, axes, True, "sum", "mean_square", lambda v, idx: v * v * inv)
    eps = tirx.const(1e-9, dtype_of(x))

    def body(*i):
        m = mean(*keep(i))
        return (x(*i) - m) / (tirx.sqrt(square(*keep(i)) - m * m) + eps)

    return [te.compute(x.shape, body, name="mvn")]


@register("RMSNormalization", attributes=["axis", "epsilon", "stash_type"])
def lower_rms_normalization(ctx):
    """x / sqrt(mean(x^2) + eps) * scale over the axes from `axis` on."""
    x, scale = ctx.tensor(0), ctx.tensor(1)
    if ctx.attr("stash_type", 1) != 1:
        raise ctx.unsupported("only stash_type=1 (float32 statistics) is supported")
    axis = ctx.axis(ctx.attr("axis", -1), x.ndim)
    axes = list(range(axis, x.ndim))
    keep, inv = _stat_axes(ctx, x, axes)
    square = reduce(x, axes, True, "sum", "mean_square", lambda v, idx: v * v * inv)
    eps = tirx.const(float(ctx.attr("epsilon", 1e-5)), dtype_of(x))
    offset = x.ndim - scale.ndim

    def body(*i):
        s = scale(*[0 if int(d) == 1 else i[offset + k] for k, d in enumerate(scale.shape)])
        return x(*i) / tirx.sqrt(square(*keep(i)) + eps) * s

    return [te.compute(x.shape, body, name="rms_normalization")]


@register("GroupNormalization", attributes=["epsilon", "num_groups", "stash_type"])
def lower_group_normalization(ctx):
    """Statistics per (sample, group of C / G channels); scale and bias per group before opset 21, per
    channel since."""
    x, gamma, beta = ctx.tensor(0), ctx.tensor(1), ctx.tensor(2)
    groups = int(ctx.attr("num_groups"))
    if ctx.attr("stash_type", 1) != 1:
        raise ctx.unsupported("only stash_type=1 (float32 statistics) is supported")
    n, channels, *spatial = shape_of(x)
    if channels % groups:
        raise ctx.unsupported(f"{channels} channels are not divisible into {groups} groups")
    per = channels // groups
    grouped = te.compute((n, groups, per * int(np.prod(spatial))), lambda i, g, k: x(
        i, g * per + tirx.floordiv(k, int(np.prod(spatial))),
        *_unflatten(tirx.floormod(k, int(np.prod(spatial))), spatial)), name="grouped")
    inv = tirx.const(1.0 / (per * int(np.prod(spatial))), dtype_of(x))
    mean = reduce(grouped, [2], True, "sum", "mean", lambda v, idx: v * inv)
    var = reduce(grouped, [2], True, "sum", "var",
                 lambda v, idx: (v - mean(idx[0], idx[1], 0)) * (v - mean(idx[0], idx[1], 0)) * inv)
    eps = tirx.const(float(ctx.attr("epsilon", 1e-5)), dtype_of(x))
    per_group = shape_of(gamma) == (groups,) and groups != channels

    def body(i, c, *rest):
        g = tirx.floordiv(c, per)
        k = g if per_group else c
        return (x(i, c, *rest) - mean(i, g, 0)) / tirx.sqrt(var(i, g, 0) + eps) * gamma(k) + beta(k)

    return [te.compute(x.shape, body, name="group_norm")]


def _unflatten(flat, shape):
    index = []
    for d in reversed(shape[1:]):
        index.append(tirx.floormod(flat, d))
        flat = tirx.floordiv(flat, d)
    return [flat] + list(reversed(index))
