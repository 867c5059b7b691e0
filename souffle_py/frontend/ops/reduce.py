"""Reductions (ReduceSum/Mean/Max/Min/Prod, with attribute or input axes), Softmax and LogSoftmax."""

from __future__ import annotations

import numpy as np
from tvm import te, tirx

from souffle_py.frontend.context import register
from souffle_py.frontend.ops.util import dtype_of, shape_of

# In these opsets the axes moved from an attribute to an input.
AXES_INPUT_SINCE = {"ReduceSum": 13}
DEFAULT_AXES_INPUT_SINCE = 18

COMBINERS = {
    "sum": te.sum,
    "max": te.max,
    "min": te.min,
    "prod": te.comm_reducer(lambda a, b: a * b, lambda t: tirx.const(1, t), name="prod"),
}


def reduce(x: te.Tensor, axes, keepdims: bool, kind: str, name: str, element=lambda v, idx: v) -> te.Tensor:
    """Reduce x over `axes` with combiner `kind`; element(value, full_index) transforms each term."""
    shape = shape_of(x)
    axes = sorted(axes)
    raxes = [te.reduce_axis((0, shape[a]), name=f"r{a}") for a in axes]
    out_shape = [1 if i in axes else d for i, d in enumerate(shape) if keepdims or i not in axes]

    def body(*idx):
        rit, kept, full = iter(raxes), iter(idx), []
        for i in range(len(shape)):
            if i in axes:
                full.append(next(rit))
                if keepdims:
                    next(kept)
            else:
                full.append(next(kept))
        return COMBINERS[kind](element(x(*full), full), axis=raxes)

    return te.compute(tuple(out_shape), body, name=name)


def _reduce_rule(op_type, kind, mean=False):
    def rule(ctx):
        x = ctx.tensor(0)
        rank = x.ndim
        since = AXES_INPUT_SINCE.get(op_type, DEFAULT_AXES_INPUT_SINCE)
        axes = ctx.attr("axes") if ctx.opset < since else ctx.ints_from("", 1, "axes")
        if not axes:
            if ctx.attr("noop_with_empty_axes", 0):
                return [x]
            axes = list(range(rank))
        axes = sorted({ctx.axis(a, rank) for a in axes})
        keepdims = bool(ctx.attr("keepdims", 1))
        if mean:
            count = int(np.prod([shape_of(x)[a] for a in axes]))
            scale = tirx.const(1.0 / count, dtype_of(x))
            out = reduce(x, axes, keepdims, "sum", "mean", lambda v, idx: v * scale)
        else:
            out = reduce(x, axes, keepdims, kind, kind)
        return [out]
    return rule


for _op, _kind, _mean in [("ReduceSum", "sum", False), ("ReduceMean", "sum", True), ("ReduceMax", "max", False),
                          ("ReduceMin", "min", False), ("ReduceProd", "prod", False)]:
    register(_op, attributes=["axes", "keepdims", "noop_with_empty_axes"])(_reduce_rule(_op, _kind, _mean))


def softmax(x: te.Tensor, axes) -> te.Tensor:
    """exp(x - max) / sum(exp(x - max)) over `axes`, as three TEs (row max, row sum, normalize)."""
    row_max = reduce(x, axes, True, "max", "max")
    keep = lambda idx: [0 if i in axes else v for i, v in enumerate(idx)]  # noqa: E731
    row_sum = reduce(x, axes, True, "sum", "expsum", lambda v, idx: tirx.exp(v - row_max(*keep(idx))))
    return te.compute(x.shape, lambda *idx: tirx.exp(x(*idx) - row_max(*keep(idx))) / row_sum(*keep(idx)),
                      name="softmax")


def softmax_axes(ctx, x: te.Tensor) -> list[int]:
    """The axes Softmax and LogSoftmax normalize over."""
    if ctx.opset >= 13:
        return [ctx.axis(ctx.attr("axis", -1), x.ndim)]
    # opset < 13: the input is coerced to 2-D at `axis` and normalized over the trailing block
    return list(range(ctx.axis(ctx.attr("axis", 1), x.ndim), x.ndim))


@register("Softmax", attributes=["axis"])
def lower_softmax(ctx):
    x = ctx.tensor(0)
    return [softmax(x, softmax_axes(ctx, x))]


@register("LogSoftmax", attributes=["axis"])
def lower_log_softmax(ctx):
    """x - max - log(sum(exp(x - max))) over the same axes as Softmax, as three TEs."""
    x = ctx.tensor(0)
    axes = softmax_axes(ctx, x)
    row_max = reduce(x, axes, True, "max", "max")
    keep = lambda idx: [0 if i in axes else v for i, v in enumerate(idx)]  # noqa: E731
    row_sum = reduce(x, axes, True, "sum", "expsum", lambda v, idx: tirx.exp(v - row_max(*keep(idx))))
    return [te.compute(x.shape, lambda *idx: x(*idx) - row_max(*keep(idx)) - tirx.log(row_sum(*keep(idx))),
                       name="log_softmax")]
