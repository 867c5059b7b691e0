"""Convolutions: Conv (1-D/2-D/3-D, groups, depthwise, strides, dilations, pads, auto_pad) and ConvTranspose.

The convolution is one TE over an explicitly padded input (topi.nn.pad, only when there is padding, unlike
topi.nn.conv which always copies the input). The weight is read in ONNX's layout [out_channels,
in_channels / group, *kernel]; a target's layout for it is a pass (te_passes/conv_weights.py, registered as
block_conv_weights in passes/cpu.py and passes/cuda.py).
"""

from __future__ import annotations

import numpy as np
from tvm import te, topi

from souffle_py.frontend.context import register
from souffle_py.frontend.ops.shape import strided_view
from souffle_py.frontend.ops.util import dtype_of, shape_of

CONV_ATTRIBUTES = ["auto_pad", "dilations", "group", "kernel_shape", "pads", "strides"]


def conv_geometry(ctx, in_spatial, kernel):
    """(strides, dilations, pads_begin, pads_end) of a Conv/pool node, auto_pad resolved per ONNX."""
    dims = len(in_spatial)
    strides = list(ctx.attr("strides", [1] * dims))
    dilations = list(ctx.attr("dilations", [1] * dims))
    auto_pad = ctx.attr("auto_pad", "NOTSET")
    if len(strides) != dims or len(dilations) != dims:
        raise ctx.unsupported(f"strides {strides} / dilations {dilations} need {dims} entries")
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        begin, end = [], []
        for size, k, s, d in zip(in_spatial, kernel, strides, dilations):
            total = max(0, (-(-size // s) - 1) * s + (k - 1) * d + 1 - size)
            small = total // 2
            begin.append(small if auto_pad == "SAME_UPPER" else total - small)
            end.append(total - begin[-1])
        return strides, dilations, begin, end
    if auto_pad == "VALID":
        return strides, dilations, [0] * dims, [0] * dims
    if auto_pad != "NOTSET":
        raise ctx.unsupported(f"auto_pad={auto_pad!r} is not supported")
    pads = list(ctx.attr("pads", [0] * 2 * dims))
    if len(pads) != 2 * dims:
        raise ctx.unsupported(f"pads {pads} need {2 * dims} entries")
    return strides, dilations, pads[:dims], pads[dims:]


def pad_spatial(x: te.Tensor, begin, end) -> te.Tensor:
    """x zero-padded on its spatial axes (all but the first two); x itself when nothing is padded."""
    if not any(begin) and not any(end):
        return x
    return topi.nn.pad(x, [0, 0, *begin], [0, 0, *end], name="pad")


def conv(x: te.Tensor, weight: te.Tensor, groups: int, strides, dilations, pads_begin, pads_end) -> te.Tensor:
    """out[n, f, o...] = sum_{c, r...} xpad[n, group(f) * C/g + c, o * s + r * d] * w[f, c, r...]."""
    batch, channels, *in_spatial = shape_of(x)
    filters, group_channels, *kernel = shape_of(weight)
    if channels != group_channels * groups or filters % groups:
        raise ValueError(f"{channels} input channels and {filters} filters do not split into {groups} groups "
                         f"of {group_channels} input channels")
    out_spatial = [(size + b + e - (k - 1) * d - 1) // s + 1
                   for size, k, s, d, b, e in zip(in_spatial, kernel, strides, dilations, pads_begin, pads_end)]
    if min(out_spatial, default=1) < 1:
        raise ValueError(f"the kernel {kernel} does not fit the padded input {in_spatial}")
    padded = pad_spatial(x, pads_begin, pads_end)
    filters_per_group = filters // groups
    rc = te.reduce_axis((0, group_channels), name="rc")
    rk = [te.reduce_axis((0, k), name=f"r{i}") for i, k in enumerate(kernel)]

    def body(n, f, *o):
        channel = rc if groups == 1 else f // filters_per_group * group_channels + rc
        window = [oi * s + r * d for oi, s, r, d in zip(o, strides, rk, dilations)]
        return te.sum(padded(n, channel, *window) * weight(f, rc, *rk), axis=[rc, *rk])

    return te.compute((batch, filters, *out_spatial), body, name="conv")


def add_bias(ctx, out: te.Tensor, index: int) -> te.Tensor:
    """out + B[f] over the channel axis when optional input `index` is given."""
    if not ctx.has(index):
        return out
    bias = ctx.tensor(index)
    if shape_of(bias) != (shape_of(out)[1],):
        raise ctx.unsupported(f"bias of shape {list(shape_of(bias))} does not match {shape_of(out)[1]} channels")
    return te.compute(out.shape, lambda n, f, *o: out(n, f, *o) + bias(f), name="bias_add")


@register("Conv", attributes=CONV_ATTRIBUTES)
def lower_conv(ctx):
    x = ctx.tensor(0)
    if x.ndim < 3:
        raise ctx.unsupported(f"input of rank {x.ndim}: Conv needs [N, C, spatial...]")
    w_shape = ctx.shape(1)
    kernel = list(ctx.attr("kernel_shape", w_shape[2:]))
    if list(w_shape[2:]) != kernel or len(w_shape) != x.ndim:
        raise ctx.unsupported(f"weight of shape {list(w_shape)} does not fit kernel_shape {kernel}")
    if ctx.dtype(1) != dtype_of(x):
        raise ctx.unsupported(f"input and weight dtypes differ ({dtype_of(x)}, {ctx.dtype(1)})")
    strides, dilations, begin, end = conv_geometry(ctx, shape_of(x)[2:], kernel)
    try:
        out = conv(x, ctx.tensor(1), int(ctx.attr("group", 1)), strides, dilations, begin, end)
    except ValueError as exc:
        raise ctx.unsupported(str(exc)) from None
    return [add_bias(ctx, out, 2)]


@register("ConvTranspose", attributes=CONV_ATTRIBUTES + ["output_padding", "output_shape"])
def lower_conv_transpose(ctx):
    """The equivalent direct convolution: the input dilated by the strides (topi.nn.dilate) and padded by
    (k - 1) * d - pads (cropped where that is negative), convolved with the spatially flipped kernel whose
    in/out channel roles are swapped. The weight must be a compile-time constant."""
    x = ctx.tensor(0)
    batch, channels, *in_spatial = shape_of(x)
    w = ctx.const(1, "weight")
    groups = int(ctx.attr("group", 1))
    dims = len(in_spatial)
    kernel = list(ctx.attr("kernel_shape", w.shape[2:]))
    if w.ndim != x.ndim or list(w.shape[2:]) != kernel or w.shape[0] != channels or channels % groups:
        raise ctx.unsupported(f"weight of shape {list(w.shape)} does not fit input {list(shape_of(x))}, "
                              f"kernel_shape {kernel} and group {groups}")
    strides = list(ctx.attr("strides", [1] * dims))
    dilations = list(ctx.attr("dilations", [1] * dims))
    output_padding = list(ctx.attr("output_padding", [0] * dims))
    full = [s * (i - 1) + op + (k - 1) * d + 1
            for s, i, op, k, d in zip(strides, in_spatial, output_padding, kernel, dilations)]
    auto_pad = ctx.attr("auto_pad", "NOTSET")
    output_shape = ctx.attr("output_shape")
    if output_shape is None and auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        output_shape = [i * s for i, s in zip(in_spatial, strides)]
    if output_shape is not None:
        totals = [f - o for f, o in zip(full, list(output_shape)[-dims:])]
        upper = auto_pad == "SAME_UPPER"
        begin = [t // 2 if upper else t - t // 2 for t in totals]
        end = [t - b for t, b in zip(totals, begin)]
    elif auto_pad in ("NOTSET", "VALID"):
        pads = list(ctx.attr("pads", [0] * 2 * dims)) if auto_pad == "NOTSET" else [0] * 2 * dims
        begin, end = pads[:dims], pads[dims:]
    else:
        raise ctx.unsupported(f"auto_pad={auto_pad!r} is not supported")
    if min(f - b - e for f, b, e in zip(full, begin, end)) < 1:
        raise ctx.unsupported(f"pads {begin + end} leave an empty output")
    # [C, F/g, *k] -> [g, C/g, F/g, *k] -> flip k -> [g, F/g, C/g, *k] -> [F, C/g, *k]
    group_channels, filters_per_group = channels // groups, w.shape[1]
    grouped = np.flip(w.reshape(groups, group_channels, filters_per_group, *kernel), axis=tuple(range(3, 3 + dims)))
    # named after the ONNX weight, as a Conv's is: block_conv_weights makes it "{weight}_blocked"
    weight = ctx.new_param(grouped.transpose(0, 2, 1, *range(3, 3 + dims)).reshape(-1, group_channels, *kernel),
                           ctx.node.input[1])
    dilated = topi.nn.dilate(x, [1, 1, *strides], name="dilate") if max(strides) > 1 else x
    reach = [(k - 1) * d for k, d in zip(kernel, dilations)]
    before = [r - b for r, b in zip(reach, begin)]
    after = [r - e + op for r, e, op in zip(reach, end, output_padding)]
    padded = pad_spatial(dilated, [max(p, 0) for p in before], [max(p, 0) for p in after])
    crop = [(0, 1, batch), (0, 1, channels)] + [
        (max(-b, 0), 1, size - max(-b, 0) - max(-a, 0))
        for b, a, size in zip(before, after, shape_of(padded)[2:])]
    cropped = strided_view(padded, crop, "crop")
    out = conv(cropped, weight, groups, [1] * dims, dilations, [0] * dims, [0] * dims)
    return [add_bias(ctx, out, 2)]
