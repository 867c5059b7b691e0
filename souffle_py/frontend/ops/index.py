"""Index-driven operators: GatherElements, GatherND, ScatterND, ScatterElements (and its old name Scatter),
OneHot, Trilu, CumSum, TopK, Hardmax, EyeLike.

Indices given at run time are read in the TE body (a data-dependent read, normalized when negative), so
token ids from an int64 input work like constant ones. Sorting-like ops (TopK) are ranks computed by
comparison: O(n^2) per row, but one plain TE each, which every pass and schedule understands (topi's sort
is an extern call the TE passes cannot look into). Conditional sums are written as sums of Select, not
with te.sum's `where`, which the TE rebuilds do not carry.
"""

from __future__ import annotations

import numpy as np
from tvm import te, tirx, topi

from souffle_py.frontend.context import register
from souffle_py.frontend.ops.ieee import equal_or_both_nan
from souffle_py.frontend.ops.reduce import full_index, reduce
from souffle_py.frontend.ops.util import INDEX_DTYPE, dtype_of, onnx_dtype, shape_of


def _index(value, dim: int):
    """A run-time index read as int32, negative indices counted from the end of a `dim`-long axis."""
    position = value.astype(INDEX_DTYPE)
    return tirx.Select(position < 0, position + dim, position)


def _int_indices(ctx, i: int) -> te.Tensor:
    indices = ctx.tensor(i)
    if not dtype_of(indices).startswith(("int", "uint")):
        raise ctx.unsupported(f"indices must be integers, got {dtype_of(indices)}")
    return indices


@register("GatherElements", attributes=["axis"])
def lower_gather_elements(ctx):
    data, indices = ctx.tensor(0), _int_indices(ctx, 1)
    axis = ctx.axis(ctx.attr("axis", 0), data.ndim)
    if indices.ndim != data.ndim:
        raise ctx.unsupported(f"indices of rank {indices.ndim} for data of rank {data.ndim}")
    dim = shape_of(data)[axis]

    def fetch(*idx):
        src = list(idx)
        src[axis] = _index(indices(*idx), dim)
        return data(*src)

    return [te.compute(indices.shape, fetch, name="gather_elements")]


@register("GatherND", attributes=["batch_dims"])
def lower_gather_nd(ctx):
    data, indices = ctx.tensor(0), _int_indices(ctx, 1)
    batch = int(ctx.attr("batch_dims", 0))
    dshape, ishape = shape_of(data), shape_of(indices)
    depth = ishape[-1]
    if batch + depth > len(dshape) or shape_of(indices)[:batch] != dshape[:batch]:
        raise ctx.unsupported(f"indices of shape {list(ishape)} do not fit data of shape {list(dshape)} "
                              f"with batch_dims={batch}")
    out_shape = ishape[:-1] + dshape[batch + depth:]

    def fetch(*idx):
        idx = list(idx)
        lead, rest = idx[:len(ishape) - 1], idx[len(ishape) - 1:]
        picked = [_index(indices(*lead, j), dshape[batch + j]) for j in range(depth)]
        return data(*lead[:batch], *picked, *rest)

    return [te.compute(tuple(out_shape), fetch, name="gather_nd")]


SCATTER_REDUCTIONS = {"none": lambda old, new: new, "add": lambda old, new: old + new,
                      "mul": lambda old, new: old * new, "max": tirx.max, "min": tirx.min}


@register("ScatterND", attributes=["reduction"])
def lower_scatter_nd(ctx):
    """data with slices replaced (or combined by `reduction`) by updates at compile-time-constant indices,
    as the dynamo exporter writes a slice assignment (x[1:] = y)."""
    data, updates = ctx.tensor(0), ctx.tensor(2)
    indices = np.asarray(ctx.const(1, "indices")).astype(np.int64)
    dshape, depth = shape_of(data), indices.shape[-1]
    if depth > len(dshape) or shape_of(updates) != tuple(indices.shape[:-1]) + tuple(dshape[depth:]):
        raise ctx.unsupported(f"indices of shape {list(indices.shape)} and updates of shape "
                              f"{list(shape_of(updates))} do not fit data of shape {list(dshape)}")
    return [_scatter(ctx, data, updates, indices.reshape(-1, depth), indices.shape[:-1], "scatter_nd")]


@register("Scatter", attributes=["axis"])
@register("ScatterElements", attributes=["axis", "reduction"])
def lower_scatter_elements(ctx):
    """data with elements replaced (or combined) by updates[j] at j with its `axis` coordinate taken from
    compile-time-constant indices[j] (torch's scatter): ScatterND at the points those indices name."""
    data, updates = ctx.tensor(0), ctx.tensor(2)
    indices = np.asarray(ctx.const(1, "indices")).astype(np.int64)
    axis = ctx.axis(ctx.attr("axis", 0), data.ndim)
    if indices.ndim != data.ndim or shape_of(updates) != indices.shape:
        raise ctx.unsupported(f"indices of shape {list(indices.shape)} and updates of shape "
                              f"{list(shape_of(updates))} do not fit data of rank {data.ndim}")
    points = np.indices(indices.shape).reshape(data.ndim, -1).T.copy()
    points[:, axis] = indices.reshape(-1)
    return [_scatter(ctx, data, updates, points, indices.shape, "scatter_elements")]


def _scatter(ctx, data, updates, points, lead, name: str) -> te.Tensor:
    """data with updates[u] (u over `lead`, row-major) stored at the leading coordinates points[u]: an
    affine read where the points step evenly along one axis; others through constant tables of update
    numbers (-1: kept), one per repetition of a point, combined in index order ('none': the last wins)."""
    reduction = ctx.attr("reduction", "none")
    if reduction not in SCATTER_REDUCTIONS:
        raise ctx.unsupported(f"reduction '{reduction}' is not supported")
    combine = SCATTER_REDUCTIONS[reduction]
    dshape, depth = shape_of(data), points.shape[-1]
    bounds = np.asarray(dshape[:depth], np.int64)
    if ((points < -bounds) | (points >= bounds)).any():
        raise ctx.unsupported(f"an index is out of range for data of shape {list(dshape)}")
    points = np.where(points < 0, points + bounds, points)
    if depth == 1 and len(points) > 1 and len(np.unique(np.diff(points[:, 0]))) == 1 and points[1, 0] != points[0, 0]:
        start, step, count = int(points[0, 0]), int(points[1, 0] - points[0, 0]), len(points)

        def body(*idx):
            offset = idx[0] - start
            number = tirx.floordiv(offset, step)
            inside = tirx.all(tirx.floormod(offset, step) == 0, number >= 0, number < count)
            return tirx.if_then_else(inside, combine(data(*idx), updates(*_unflatten(number, lead), *idx[1:])),
                                     data(*idx))
        return te.compute(data.shape, body, name=name)
    tables, seen = [], {}
    for number, point in enumerate(map(tuple, points)):
        k = 0 if reduction == "none" else seen.get(point, 0)
        seen[point] = k + 1
        if k == len(tables):
            tables.append(np.full(dshape[:depth], -1, np.int32))
        tables[k][point] = number
    slots = [ctx.new_param(table, f"{name}_slots") for table in tables]

    def fetch(*idx):
        value = data(*idx)
        for table in slots:
            slot = table(*idx[:depth])
            update = updates(*_unflatten(tirx.max(slot, 0), lead), *idx[depth:])
            value = tirx.if_then_else(slot >= 0, combine(value, update), value)
        return value
    return te.compute(data.shape, fetch, name=name)


def _unflatten(number, shape) -> list:
    """The row-major index into `shape` of element `number`."""
    index = []
    for extent in reversed(shape):
        index.append(tirx.floormod(number, int(extent)))
        number = tirx.floordiv(number, int(extent))
    return index[::-1]


@register("OneHot", attributes=["axis"])
def lower_one_hot(ctx):
    """out = on where the index (negative: from the end) equals the position along `axis`, else off."""
    indices = ctx.tensor(0)
    depth = int(np.asarray(ctx.const(1, "depth")).reshape(-1)[0])
    values = ctx.tensor(2)
    rank = indices.ndim + 1
    axis = ctx.axis(ctx.attr("axis", -1), rank)
    shape = list(shape_of(indices))
    shape.insert(axis, depth)

    def body(*idx):
        idx = list(idx)
        position = idx.pop(axis)
        index = indices(*idx)
        if dtype_of(index).startswith("float"):
            index = tirx.trunc(index)
        index = index.astype("int64")
        index = tirx.Select(index < 0, index + depth, index)
        return tirx.Select(index == position.astype("int64"), values(1), values(0))

    return [te.compute(tuple(shape), body, name="one_hot")]


@register("Trilu", attributes=["upper"])
def lower_trilu(ctx):
    """Keep the upper (j - i >= k) or lower (j - i <= k) triangle of the last two axes, zero the rest."""
    x = ctx.tensor(0)
    if x.ndim < 2:
        raise ctx.unsupported(f"input of rank {x.ndim}: Trilu needs at least 2 axes")
    k = int(np.asarray(ctx.const(1, "k")).reshape(-1)[0]) if ctx.has(1) else 0
    upper = bool(ctx.attr("upper", 1))
    zero = tirx.const(0, dtype_of(x))

    def body(*idx):
        i, j = idx[-2], idx[-1]
        keep = (j - i >= k) if upper else (j - i <= k)
        return tirx.Select(keep, x(*idx), zero)

    return [te.compute(x.shape, body, name="trilu")]


@register("CumSum", attributes=["exclusive", "reverse"])
def lower_cumsum(ctx):
    """out[i] = sum of x[r] over r <= i (< for exclusive; >= / > when reversed) along the axis."""
    x = ctx.tensor(0)
    axis = ctx.axis(int(np.asarray(ctx.const(1, "axis")).reshape(-1)[0]), x.ndim)
    exclusive, reverse = bool(ctx.attr("exclusive", 0)), bool(ctx.attr("reverse", 0))
    r = te.reduce_axis((0, shape_of(x)[axis]), name="r")

    def body(*idx):
        i = idx[axis]
        cond = {(False, False): r <= i, (True, False): r < i, (False, True): r >= i, (True, True): r > i}
        src = list(idx)
        src[axis] = r
        return te.sum(tirx.Select(cond[(exclusive, reverse)], x(*src), tirx.const(0, dtype_of(x))), axis=r)

    return [te.compute(x.shape, body, name="cumsum")]


@register("TopK", attributes=["axis", "largest", "sorted"])
def lower_top_k(ctx):
    """Values and int64 indices of the k largest (smallest) elements along `axis`, ties to the lower index;
    k must be a compile-time constant. rank[i] = how many elements come before element i; output p is the
    element of rank p."""
    x = ctx.tensor(0)
    if ctx.opset < 10:
        k = int(ctx.attr("k"))
    else:
        k = int(np.asarray(ctx.const(1, "k")).reshape(-1)[0])
    axis = ctx.axis(ctx.attr("axis", -1), x.ndim)
    largest = bool(ctx.attr("largest", 1))
    n = shape_of(x)[axis]
    if not 0 < k <= n:
        raise ctx.unsupported(f"k={k} is not in 1..{n}")
    r = te.reduce_axis((0, n), name="r")

    def at(idx, position):
        src = list(idx)
        src[axis] = position
        return src

    def before(other, i, idx):
        a, b = x(*at(idx, other)), x(*at(idx, i))
        return tirx.Or(a > b if largest else a < b, tirx.And(a == b, other < i))

    rank = te.compute(x.shape, lambda *idx: te.sum(tirx.Select(before(r, idx[axis], idx), 1, 0), axis=r),
                      name="rank")
    out_shape = list(shape_of(x))
    out_shape[axis] = k
    r2 = te.reduce_axis((0, n), name="r")
    zero = tirx.const(0, dtype_of(x))
    values = te.compute(tuple(out_shape), lambda *idx: te.sum(tirx.Select(
        rank(*at(idx, r2)) == idx[axis], x(*at(idx, r2)), zero), axis=r2), name="topk")
    r3 = te.reduce_axis((0, n), name="r")
    indices = te.compute(tuple(out_shape), lambda *idx: te.sum(tirx.Select(
        rank(*at(idx, r3)) == idx[axis], r3.var.astype("int64"), tirx.const(0, "int64")), axis=r3),
        name="topk_indices")
    return [values, indices]


@register("Hardmax", attributes=["axis"])
def lower_hardmax(ctx):
    """1 at the first maximum along `axis` (before opset 13: over the flattened trailing axes), else 0."""
    x = ctx.tensor(0)
    shape = shape_of(x)
    if ctx.opset >= 13:
        axis, flat = ctx.axis(ctx.attr("axis", -1), x.ndim), x
    else:
        split = ctx.axis(ctx.attr("axis", 1), x.ndim)
        flat = topi.reshape(x, [int(np.prod(shape[:split])), int(np.prod(shape[split:]))])
        axis = 1
    arg = _first_max(flat, axis)
    one, zero = tirx.const(1, dtype_of(x)), tirx.const(0, dtype_of(x))
    hard = te.compute(flat.shape, lambda *idx: tirx.Select(
        idx[axis].astype("int64") == arg(*[0 if i == axis else v for i, v in enumerate(idx)]), one, zero),
        name="hardmax")
    return [hard if flat is x else topi.reshape(hard, list(shape))]


def _first_max(x: te.Tensor, axis: int) -> te.Tensor:
    """int64 index of the first maximum along `axis`, kept as a size-1 axis."""
    peak = reduce(x, [axis], True, "max", "max")
    r = te.reduce_axis((0, shape_of(x)[axis]), name="r")
    none = tirx.const(shape_of(x)[axis], "int64")

    def body(*idx):
        full = full_index(idx, [r], [axis], x.ndim, True)
        return te.min(tirx.Select(equal_or_both_nan(x(*full), peak(*idx)), r.var.astype("int64"), none), axis=r)

    return te.compute(peak.shape, body, name="argmax")


@register("EyeLike", attributes=["dtype", "k"])
def lower_eye_like(ctx):
    """A constant: only the input's shape matters."""
    shape = ctx.shape(0)
    if len(shape) != 2:
        raise ctx.unsupported(f"input of rank {len(shape)}: EyeLike needs a 2-D input")
    dtype = onnx_dtype(ctx.attr("dtype")) if "dtype" in ctx.attrs else ctx.dtype(0)
    return [np.eye(shape[0], shape[1], k=int(ctx.attr("k", 0)), dtype=dtype)]
