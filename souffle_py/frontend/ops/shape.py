"""Data-movement operators: Reshape, Transpose, (Un)Squeeze, Flatten, Concat, Slice, Split, Gather, Expand,
Shape, Pad, Tile (ConstantOfShape and Range are folded: their inputs must be constants). Each is one TE
whose index expressions say exactly which element it reads (the analysis relies on that), and every
shape-like argument must be a compile-time constant."""

from __future__ import annotations

import numpy as np
from tvm import te, tirx, topi

from souffle_py.frontend.context import register
from souffle_py.frontend.ops.util import dtype_of, INDEX_DTYPE, broadcast_indices, broadcast_shape, shape_of


def reindex(x: te.Tensor, out_shape, index_fn, name: str) -> te.Tensor:
    """out[idx] = x[index_fn(idx)]."""
    return te.compute(tuple(out_shape), lambda *idx: x(*index_fn(list(idx))), name=name)


@register("Reshape", attributes=["allowzero", "shape"])
def lower_reshape(ctx):
    x = ctx.tensor(0)
    in_shape = shape_of(x)
    target = ctx.ints_from("shape", 1, "target shape")
    allow_zero = bool(ctx.attr("allowzero", 0))
    shape = [in_shape[i] if d == 0 and not allow_zero else d for i, d in enumerate(target)]
    if shape.count(-1) > 1:
        raise ctx.unsupported(f"target shape {target} has more than one -1")
    if -1 in shape:
        known = int(np.prod([d for d in shape if d != -1]))
        if known == 0 or int(np.prod(in_shape)) % known:
            raise ctx.unsupported(f"cannot reshape {list(in_shape)} to {target}")
        shape[shape.index(-1)] = int(np.prod(in_shape)) // known
    if int(np.prod(shape)) != int(np.prod(in_shape)):
        raise ctx.unsupported(f"cannot reshape {list(in_shape)} ({int(np.prod(in_shape))} elements) to {target}")
    return [reshape(x, shape)]


def reshape(x: te.Tensor, shape) -> te.Tensor:
    return topi.reshape(x, [int(d) for d in shape]) if list(shape) != list(shape_of(x)) else x


@register("Flatten", attributes=["axis"])
def lower_flatten(ctx):
    x = ctx.tensor(0)
    shape = shape_of(x)
    axis = ctx.attr("axis", 1)
    if not -len(shape) <= axis <= len(shape):
        raise ctx.unsupported(f"axis {axis} is out of range for a rank-{len(shape)} tensor")
    axis = axis + len(shape) if axis < 0 else axis
    return [reshape(x, [int(np.prod(shape[:axis])), int(np.prod(shape[axis:]))])]


@register("Transpose", attributes=["perm"])
def lower_transpose(ctx):
    x = ctx.tensor(0)
    perm = ctx.attr("perm") or list(reversed(range(x.ndim)))
    if sorted(perm) != list(range(x.ndim)):
        raise ctx.unsupported(f"perm {list(perm)} is not a permutation of {x.ndim} axes")
    if list(perm) == list(range(x.ndim)):
        return [x]
    out_shape = [shape_of(x)[p] for p in perm]

    def index(idx):
        src = [None] * len(perm)
        for out_axis, in_axis in enumerate(perm):
            src[in_axis] = idx[out_axis]
        return src

    return [reindex(x, out_shape, index, "transpose")]


@register("Unsqueeze", attributes=["axes"])
def lower_unsqueeze(ctx):
    x = ctx.value(0)
    axes = ctx.ints_from("axes", 1, "axes")
    if axes is None:
        raise ctx.unsupported("axes are required")
    rank = len(shape_of(x)) + len(axes)
    axes = sorted(ctx.axis(a, rank) for a in axes)
    out_shape, it = [], iter(shape_of(x))
    for i in range(rank):
        out_shape.append(1 if i in axes else next(it))
    x = ctx.tensor(0)
    return [reindex(x, out_shape, lambda idx: [v for i, v in enumerate(idx) if i not in axes], "unsqueeze")]


@register("Squeeze", attributes=["axes"])
def lower_squeeze(ctx):
    x = ctx.tensor(0)
    shape = shape_of(x)
    axes = ctx.ints_from("axes", 1, "axes")
    axes = [i for i, d in enumerate(shape) if d == 1] if axes is None else [ctx.axis(a, len(shape)) for a in axes]
    for a in axes:
        if shape[a] != 1:
            raise ctx.unsupported(f"cannot squeeze axis {a} of size {shape[a]}")
    out_shape = [d for i, d in enumerate(shape) if i not in axes]

    def index(idx):
        it = iter(idx)
        return [0 if i in axes else next(it) for i in range(len(shape))]

    return [reindex(x, out_shape, index, "squeeze")]


@register("Concat", attributes=["axis"])
def lower_concat(ctx):
    tensors = [ctx.tensor(i) for i in range(ctx.num_inputs) if ctx.has(i)]
    axis = ctx.axis(ctx.attr("axis"), tensors[0].ndim)
    tensors = [t for t in tensors if shape_of(t)[axis] > 0]
    if len(tensors) == 1:
        return [tensors[0]]
    return [topi.concatenate(tensors, axis)]


def slice_ranges(shape, starts, ends, axes, steps):
    """Per-axis (start, step, length) with ONNX clamping (Python's slice semantics agree with it)."""
    ranges = [(0, 1, d) for d in shape]
    for start, end, axis, step in zip(starts, ends, axes, steps):
        if step == 0:
            raise ValueError("a step of 0")
        begin, stop, stride = slice(int(start), int(end), int(step)).indices(shape[axis])
        ranges[axis] = (begin, stride, len(range(begin, stop, stride)))
    return ranges


@register("Slice", attributes=["starts", "ends", "axes"])
def lower_slice(ctx):
    x = ctx.tensor(0)
    shape = shape_of(x)
    if ctx.opset < 10:
        starts, ends = ctx.attr("starts"), ctx.attr("ends")
        axes = ctx.attr("axes", list(range(len(starts))))
        steps = [1] * len(starts)
    else:
        starts, ends = ctx.ints_from("", 1, "starts"), ctx.ints_from("", 2, "ends")
        axes = ctx.ints_from("", 3, "axes") or list(range(len(starts)))
        steps = ctx.ints_from("", 4, "steps") or [1] * len(starts)
    axes = [ctx.axis(a, len(shape)) for a in axes]
    if len({len(starts), len(ends), len(axes), len(steps)}) != 1 or len(set(axes)) != len(axes):
        raise ctx.unsupported("starts, ends, axes and steps must have one entry per distinct axis")
    if 0 in steps:
        raise ctx.unsupported("a step of 0 is not allowed")
    ranges = slice_ranges(shape, starts, ends, axes, steps)
    return [strided_view(x, ranges, "slice")]


def strided_view(x: te.Tensor, ranges, name: str) -> te.Tensor:
    """out[i...] = x[start + i * step ...] per axis; the identity when nothing is cut."""
    if all(r == (0, 1, d) for r, d in zip(ranges, shape_of(x))):
        return x
    return reindex(x, [n for _, _, n in ranges],
                   lambda idx: [start + i * step for i, (start, step, _) in zip(idx, ranges)], name)


@register("Split", attributes=["axis", "split", "num_outputs"])
def lower_split(ctx):
    x = ctx.tensor(0)
    shape = shape_of(x)
    axis = ctx.axis(ctx.attr("axis", 0), len(shape))
    sizes = ctx.ints_from("split", 1, "split sizes")
    if sizes is None:
        parts = ctx.attr("num_outputs", len(ctx.node.output))
        chunk = -(-shape[axis] // parts)
        sizes = [min(chunk, shape[axis] - i * chunk) for i in range(parts)]
    if sum(sizes) != shape[axis] or len(sizes) != len(ctx.node.output):
        raise ctx.unsupported(f"split sizes {sizes} do not cover axis {axis} of size {shape[axis]} "
                              f"with {len(ctx.node.output)} outputs")
    outputs, offset = [], 0
    for size in sizes:
        ranges = [(0, 1, d) for d in shape]
        ranges[axis] = (offset, 1, size)
        outputs.append(strided_view(x, ranges, "split"))
        offset += size
    return outputs


@register("Gather", attributes=["axis"])
def lower_gather(ctx):
    data = ctx.tensor(0)
    shape = shape_of(data)
    axis = ctx.axis(ctx.attr("axis", 0), len(shape))
    dim = shape[axis]
    if ctx.is_const(1):
        indices = np.asarray(ctx.const(1)).astype(np.int64)
        if ((indices < -dim) | (indices >= dim)).any():
            raise ctx.unsupported(f"indices out of range for axis {axis} of size {dim}")
        indices = np.where(indices < 0, indices + dim, indices)
        if indices.ndim == 0:  # a constant scalar index is an affine read: data[..., k, ...]
            k = int(indices)
            return [reindex(data, shape[:axis] + shape[axis + 1:],
                            lambda idx: idx[:axis] + [k] + idx[axis:], "gather")]
        original = ctx.const(1)
        index_tensor = ctx.tensor(1) if (indices == original).all() and original.dtype == indices.dtype \
            else ctx.new_param(indices, f"{ctx.node.input[1]}_normalized")
        normalize = False
    else:
        index_tensor = ctx.tensor(1)
        if not dtype_of(index_tensor).startswith("int"):
            raise ctx.unsupported(f"indices must be integers, got {dtype_of(index_tensor)}")
        normalize = True
    ishape = shape_of(index_tensor)
    out_shape = shape[:axis] + ishape + shape[axis + 1:]

    def fetch(*idx):
        idx = list(idx)
        position = index_tensor(*idx[axis:axis + len(ishape)]).astype(INDEX_DTYPE)
        if normalize:
            position = tirx.Select(position < 0, position + dim, position)
        return data(*idx[:axis], position, *idx[axis + len(ishape):])

    return [te.compute(tuple(out_shape), fetch, name="gather")]


@register("Expand")
def lower_expand(ctx):
    x = ctx.tensor(0)
    shape = broadcast_shape(shape_of(x), [int(d) for d in ctx.const(1, "shape")])
    if shape == shape_of(x):
        return [x]
    return [reindex(x, shape, lambda idx: broadcast_indices(idx, shape_of(x)), "expand")]


@register("Shape", attributes=["start", "end"])
def lower_shape(ctx):
    shape = np.array(ctx.shape(0), dtype=np.int64)
    start, end = ctx.attr("start", 0), ctx.attr("end", None)
    return [shape[start:end]]


@register("Size")
def lower_size(ctx):
    return [np.array(int(np.prod(ctx.shape(0))), dtype=np.int64)]


PAD_MODES = {"reflect": topi.nn.reflect_pad, "edge": topi.nn.replicate_pad, "wrap": topi.nn.circular_pad}


@register("Pad", attributes=["mode", "pads", "paddings", "value"])
def lower_pad(ctx):
    """Constant, reflect, edge and wrap padding (topi); negative pads crop. Pads are attributes before opset
    11 and constant inputs since (with optional axes since opset 18)."""
    x = ctx.tensor(0)
    shape = shape_of(x)
    rank = len(shape)
    mode = ctx.attr("mode", "constant")
    if mode != "constant" and mode not in PAD_MODES:
        raise ctx.unsupported(f"mode={mode!r} is not supported")
    if ctx.opset < 11:
        pads = ctx.attr("pads", ctx.attr("paddings"))  # "paddings" in opset 1
        value = tirx.const(ctx.attr("value", 0.0), dtype_of(x))
    else:
        pads = ctx.ints_from("", 1, "pads")
        axes = ctx.ints_from("", 3, "axes")
        if axes is not None:
            full = [0] * 2 * rank
            for i, a in enumerate(ctx.axis(a, rank) for a in axes):
                full[a], full[rank + a] = pads[i], pads[len(axes) + i]
            pads = full
        value = tirx.const(0, dtype_of(x))
        if ctx.has(2):
            value = (tirx.const(ctx.const(2).reshape(-1)[0].item(), dtype_of(x)) if ctx.is_const(2)
                     else ctx.tensor(2)(*[0] * len(ctx.shape(2))))
    if pads is None or len(pads) != 2 * rank:
        raise ctx.unsupported(f"pads {pads} need {2 * rank} entries for a rank-{rank} input")
    before, after = list(pads[:rank]), list(pads[rank:])
    grow_before, grow_after = [max(p, 0) for p in before], [max(p, 0) for p in after]
    if not any(grow_before + grow_after):
        padded = x
    elif mode == "constant":
        padded = topi.nn.pad(x, grow_before, grow_after, pad_value=value, name="pad")
    else:
        limit = 1 if mode == "reflect" else 0  # reflect cannot repeat the edge, so it reaches one less far
        if any(p > d - limit for p, d in zip(grow_before + grow_after, shape + shape)):
            raise ctx.unsupported(f"{mode} padding by {list(pads)} reaches beyond the input of shape {list(shape)}")
        padded = PAD_MODES[mode](x, grow_before, grow_after, name="pad")
    crop = [(max(-b, 0), 1, d - max(-b, 0) - max(-a, 0)) for b, a, d in zip(before, after, shape_of(padded))]
    if min((n for _, _, n in crop), default=1) < 1:
        raise ctx.unsupported(f"pads {list(pads)} crop all of the input of shape {list(shape)}")
    return [strided_view(padded, crop, "crop")]


@register("Tile")
def lower_tile(ctx):
    x = ctx.tensor(0)
    if ctx.opset < 6:
        raise ctx.unsupported("the opset-1 form (tiles and axis inputs) is not supported")
    repeats = ctx.ints_from("", 1, "repeats")
    if len(repeats) != x.ndim or min(repeats, default=1) < 0:
        raise ctx.unsupported(f"repeats {repeats} must be {x.ndim} non-negative counts")
    return [x if set(repeats) <= {1} else topi.tile(x, repeats)]


@register("ConstantOfShape", attributes=["value"])
@register("Range")
def lower_data_dependent_shape(ctx):
    """With constant inputs these nodes are folded before any rule runs; reaching this rule means that the
    output's shape depends on run-time values."""
    for i in range(ctx.num_inputs):
        if ctx.has(i):
            ctx.const(i, "the output shape depends on its run-time value")  # NotConstantError if it is not one
    raise ctx.unsupported("unreachable: a node with constant inputs is folded")
