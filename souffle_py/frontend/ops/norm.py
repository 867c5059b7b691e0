"""Per-channel normalizations over [N, C, spatial...]: BatchNormalization (inference) and InstanceNormalization.

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
