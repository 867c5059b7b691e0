"""Reductions (ReduceSum/Mean/Max/Min/Prod/L1/L2/SumSquare/LogSum/LogSumExp, axes as attribute or input, every
opset since 1), ArgMax/ArgMin, Softmax and LogSoftmax."""

from __future__ import annotations

import numpy as np
from tvm import te, tirx

from souffle_py.frontend.context import register
from souffle_py.frontend.ops.ieee import MAXIMUM, MINIMUM, equal_or_both_nan
from souffle_py.frontend.ops.util import dtype_of, shape_of

# In these opsets the axes moved from an attribute to an input.
AXES_INPUT_SINCE = {"ReduceSum": 13}
DEFAULT_AXES_INPUT_SINCE = 18

COMBINERS = {
    "sum": te.sum,
    "max": te.max,
    "min": te.min,
    "prod": te.comm_reducer(lambda a, b: a * b, lambda t: tirx.const(1, t), name="prod"),
    # softmax's row max: from the lowest finite value, which GPU warp reductions (TVM's cross-thread
    # reduction) recognize; a row of -inf still gives NaN, as from -inf
    "max_from_lowest": te.max,
}
# Float max / min keep NaN and start from -inf / +inf as ONNX does (ieee.py). Softmax's row max stays plain:
# a NaN in the row makes its sum, hence the whole row, NaN either way.
FLOAT_COMBINERS = {"max": MAXIMUM, "min": MINIMUM}
_BOOL_COMBINERS = {"max": "any", "min": "all"}  # TVM has no min/max value for bool


def reduce(x: te.Tensor, axes, keepdims: bool, kind: str, name: str, element=lambda v, idx: v) -> te.Tensor:
    """Reduce x over `axes` with combiner `kind`; element(value, full_index) transforms each term."""
    shape = shape_of(x)
    axes = sorted(axes)
    raxes = [te.reduce_axis((0, shape[a]), name=f"r{a}") for a in axes]
    out_shape = [1 if i in axes else d for i, d in enumerate(shape) if keepdims or i not in axes]

    def body(*idx):
        full = full_index(idx, raxes, axes, len(shape), keepdims)
        combiner = FLOAT_COMBINERS.get(kind) if dtype_of(x).startswith("float") else None
        return (combiner or COMBINERS[kind])(element(x(*full), full), axis=raxes)

    if dtype_of(x) == "bool" and kind in _BOOL_COMBINERS:  # max/min of bools: any/all, computed in int8
        as_int = te.compute(x.shape, lambda *i: x(*i).astype("int8"), name=f"{name}_int8")
        out = reduce(as_int, axes, keepdims, kind, name)
        return te.compute(out.shape, lambda *i: out(*i) != tirx.const(0, "int8"), name=f"{name}_bool")
    return te.compute(tuple(out_shape), body, name=name)


def full_index(idx, raxes, axes, rank: int, keepdims: bool) -> list:
    """The input index of output index `idx` with reduction variables `raxes` on `axes`."""
    rit, kept, full = iter(raxes), iter(idx), []
    for i in range(rank):
        if i in axes:
            full.append(next(rit))
            if keepdims:
                next(kept)
        else:
            full.append(next(kept))
    return full


def reduce_axes(ctx, x) -> list[int] | None:
    """The sorted axes of a Reduce* node, from its attribute (older opsets) or its input; None = no-op."""
    since = AXES_INPUT_SINCE.get(ctx.op_type, DEFAULT_AXES_INPUT_SINCE)
    axes = ctx.attr("axes") if ctx.opset < since or "axes" in ctx.attrs else ctx.ints_from("", 1, "axes")
    if not axes:
        if ctx.attr("noop_with_empty_axes", 0):
            return None
        axes = list(range(x.ndim))
    return sorted({ctx.axis(a, x.ndim) for a in axes})


def _const(x, value):
    return tirx.const(value, dtype_of(x))


def _float_only(ctx, x):
    if not dtype_of(x).startswith("float"):
        raise ctx.unsupported(f"input dtype {dtype_of(x)} is not supported (floating point only)")


def _reduce_rule(op_type):
    def rule(ctx):
        x = ctx.tensor(0)
        axes = reduce_axes(ctx, x)
        if axes is None:
            return [x]
        keepdims = bool(ctx.attr("keepdims", 1))
        return [REDUCTIONS[op_type](ctx, x, axes, keepdims)]
    return rule


def _mean(ctx, x, axes, keepdims):
    count = int(np.prod([shape_of(x)[a] for a in axes]))
    if dtype_of(x).startswith("float"):  # one TE: each term scaled (LayerNorm's two means stay two TEs)
        scale = _const(x, 1.0 / count)
        return reduce(x, axes, keepdims, "sum", "mean", lambda v, idx: v * scale)
    total = reduce(x, axes, keepdims, "sum", "sum")
    return te.compute(total.shape, lambda *i: tirx.floordiv(total(*i), _const(x, count)), name="mean")


def _log_sum_exp(ctx, x, axes, keepdims):
    """max + log(sum(exp(x - max))): no overflow for large inputs."""
    _float_only(ctx, x)
    peak = reduce(x, axes, True, "max", "max")
    keep = lambda idx: [0 if i in axes else v for i, v in enumerate(idx)]  # noqa: E731
    raxes = [te.reduce_axis((0, shape_of(x)[a]), name=f"r{a}") for a in axes]

    def body(*idx):
        full = full_index(idx, raxes, axes, x.ndim, True)
        return te.sum(tirx.exp(x(*full) - peak(*keep(full))), axis=raxes)

    total = te.compute(peak.shape, body, name="expsum")

    def finish(*idx):
        src = list(idx) if keepdims else _expand(idx, axes, x.ndim)
        m = peak(*src)
        return tirx.Select(tirx.isinf(m), m, m + tirx.log(total(*src)))

    out_shape = [d for i, d in enumerate(shape_of(peak)) if keepdims or i not in axes]
    return te.compute(tuple(out_shape), finish, name="log_sum_exp")


def _expand(idx, axes, rank):
    it = iter(idx)
    return [0 if i in axes else next(it) for i in range(rank)]


def _elementwise_reduce(kind, element, finish=None, float_only=False):
    def lower(ctx, x, axes, keepdims):
        if float_only:
            _float_only(ctx, x)
        out = reduce(x, axes, keepdims, kind, kind, lambda v, idx: element(v))
        return out if finish is None else te.compute(out.shape, lambda *i: finish(out(*i)), name="finish")
    return lower


REDUCTIONS = {
    "ReduceSum": _elementwise_reduce("sum", lambda v: v),
    "ReduceMean": _mean,
    "ReduceMax": _elementwise_reduce("max", lambda v: v),
    "ReduceMin": _elementwise_reduce("min", lambda v: v),
    "ReduceProd": _elementwise_reduce("prod", lambda v: v),
    "ReduceL1": _elementwise_reduce("sum", lambda v: tirx.abs(v) if not dtype_of(v).startswith("uint") else v),
    "ReduceL2": _elementwise_reduce("sum", lambda v: v * v, tirx.sqrt, float_only=True),
    "ReduceSumSquare": _elementwise_reduce("sum", lambda v: v * v),
    "ReduceLogSum": _elementwise_reduce("sum", lambda v: v, tirx.log, float_only=True),
    "ReduceLogSumExp": _log_sum_exp,
}
for _op in REDUCTIONS:
    register(_op, attributes=["axes", "keepdims", "noop_with_empty_axes"])(_reduce_rule(_op))


@register("ArgMax", attributes=["axis", "keepdims", "select_last_index"])
@register("ArgMin", attributes=["axis", "keepdims", "select_last_index"])
def lower_arg_extreme(ctx):
    """The int64 index of the first (or last) maximum/minimum along `axis`, as two single-output reductions
    (the extreme value, then the smallest or largest index holding it): the analysis and the partitioner
    handle single-output TEs only. A NaN is the extreme of its row, as in numpy (ieee.py)."""
    x = ctx.tensor(0)
    axis = ctx.axis(ctx.attr("axis", 0), x.ndim)
    keepdims, last = bool(ctx.attr("keepdims", 1)), bool(ctx.attr("select_last_index", 0))
    if dtype_of(x) == "bool":
        x = te.compute(x.shape, lambda *i: x(*i).astype("int8"), name="as_int8")
    extreme = reduce(x, [axis], True, "max" if ctx.op_type == "ArgMax" else "min", "extreme")
    r = te.reduce_axis((0, shape_of(x)[axis]), name="r")
    out_shape = [1 if i == axis else d for i, d in enumerate(shape_of(x)) if keepdims or i != axis]
    none = tirx.const(-1 if last else shape_of(x)[axis], "int64")

    def body(*idx):
        full = full_index(idx, [r], [axis], x.ndim, keepdims)
        at = [0 if i == axis else v for i, v in enumerate(full)]
        hit = tirx.Select(equal_or_both_nan(x(*full), extreme(*at)), r.var.astype("int64"), none)
        return (te.max if last else te.min)(hit, axis=r)

    return [te.compute(tuple(out_shape), body, name=ctx.op_type.lower())]


def softmax(x: te.Tensor, axes) -> te.Tensor:
    """exp(x - max) / sum(exp(x - max)) over `axes`, as three TEs (row max, row sum, normalize)."""
    row_max = reduce(x, axes, True, "max_from_lowest", "max")
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
    row_max = reduce(x, axes, True, "max_from_lowest", "max")
    keep = lambda idx: [0 if i in axes else v for i, v in enumerate(idx)]  # noqa: E731
    row_sum = reduce(x, axes, True, "sum", "expsum", lambda v, idx: tirx.exp(v - row_max(*keep(idx))))
    return [te.compute(x.shape, lambda *idx: x(*idx) - row_max(*keep(idx)) - tirx.log(row_sum(*keep(idx))),
                       name="log_softmax")]
