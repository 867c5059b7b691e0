"""Spatial resampling and rearrangement: Resize (nearest, linear), Upsample, DepthToSpace, SpaceToDepth.

Resize is one TE whose index expressions compute each output element's source coordinate per resized
axis (ONNX's coordinate_transformation_mode), then pick the nearest element or blend the 2^d neighbours
(linear). Coordinates are computed in float64 as onnx's reference does, so floor/round boundaries agree.
Scales and sizes must be compile-time constants (the output shape depends on them).
"""

from __future__ import annotations

import itertools

import numpy as np
from tvm import te, tirx

from souffle_py.frontend.context import register
from souffle_py.frontend.ops.util import dtype_of, shape_of

COORDINATE_MODES = ("half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners", "asymmetric")
NEAREST_MODES = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil", "simple")


def _f64(value):
    return tirx.const(float(value), "float64")


def source_coordinate(x, mode: str, scale: float, in_len: int, out_len: int):
    """The input coordinate (float64 expression) of output index x along one axis."""
    xf = x.astype("float64")
    width = scale * in_len  # ONNX's output_width: the unrounded output length
    if mode == "align_corners":
        return _f64(0) if width == 1 else xf * _f64((in_len - 1) / (width - 1))
    if mode == "asymmetric":
        return xf / _f64(scale)
    if mode == "pytorch_half_pixel":
        return _f64(-0.5) if width == 1 else (xf + _f64(0.5)) / _f64(scale) - _f64(0.5)
    if mode == "half_pixel":
        return (xf + _f64(0.5)) / _f64(scale) - _f64(0.5)
    # half_pixel_symmetric
    adjustment = out_len / (scale * in_len)
    offset = in_len / 2 * (1 - adjustment)
    return _f64(offset) + (xf + _f64(0.5)) / _f64(scale) - _f64(0.5)


def _clamp(index, in_len: int):
    return tirx.max(tirx.min(index, tirx.const(in_len - 1, "int32")), tirx.const(0, "int32"))


def _nearest(coord, mode: str, scale: float, in_len: int):
    if mode == "simple":  # Resize-10 / Upsample: floor when upsampling, ceil when downsampling (as ORT)
        mode = "ceil" if scale < 1 else "floor"
    rounded = {"round_prefer_floor": lambda c: tirx.ceil(c - _f64(0.5)),
               "round_prefer_ceil": lambda c: tirx.floor(c + _f64(0.5)),
               "floor": tirx.floor, "ceil": tirx.ceil}[mode](coord)
    return _clamp(rounded.astype("int32"), in_len)


def resize(ctx, x: te.Tensor, scales: list[float], out_shape: list[int], mode: str, coordinates: str,
           nearest_mode: str) -> te.Tensor:
    in_shape = shape_of(x)
    resized = [a for a in range(x.ndim) if not (in_shape[a] == out_shape[a] and scales[a] == 1.0)]
    dtype = dtype_of(x)

    def body(*idx):
        idx = list(idx)
        if mode == "nearest":
            src = list(idx)
            for a in resized:
                coord = source_coordinate(idx[a], coordinates, scales[a], in_shape[a], out_shape[a])
                src[a] = _nearest(coord, nearest_mode, scales[a], in_shape[a])
            return x(*src)
        lows, weights = {}, {}
        for a in resized:
            coord = source_coordinate(idx[a], coordinates, scales[a], in_shape[a], out_shape[a])
            coord = tirx.max(tirx.min(coord, _f64(in_shape[a] - 1)), _f64(0))
            low = tirx.floor(coord)
            lows[a] = low.astype("int32")
            weights[a] = (coord - low).astype("float64")
        total = None
        for corner in itertools.product((0, 1), repeat=len(resized)):
            src, weight = list(idx), _f64(1)
            for a, step in zip(resized, corner):
                src[a] = _clamp(lows[a] + step, in_shape[a])
                weight = weight * (weights[a] if step else _f64(1) - weights[a])
            term = x(*src).astype("float64") * weight
            total = term if total is None else total + term
        return total.astype(dtype)

    return te.compute(tuple(out_shape), body, name="resize")


def _scales_and_shape(ctx, x, scales, sizes, axes):
    in_shape = shape_of(x)
    rank = x.ndim
    axes = list(range(rank)) if axes is None else [ctx.axis(a, rank) for a in axes]
    if sizes is not None:
        if len(sizes) != len(axes):
            raise ctx.unsupported(f"sizes {sizes} need one entry per axis {axes}")
        policy = ctx.attr("keep_aspect_ratio_policy", "stretch")
        ratios = [s / in_shape[a] for s, a in zip(sizes, axes)]
        if policy in ("not_larger", "not_smaller"):
            common = min(ratios) if policy == "not_larger" else max(ratios)
            ratios = [common] * len(axes)
            sizes = [int(np.floor(common * in_shape[a] + 0.5)) for a in axes]
        elif policy != "stretch":
            raise ctx.unsupported(f"keep_aspect_ratio_policy={policy!r}")
        full_scales, out_shape = [1.0] * rank, list(in_shape)
        for a, s, r in zip(axes, sizes, ratios):
            full_scales[a], out_shape[a] = float(r), int(s)
        return full_scales, out_shape
    if scales is None or len(scales) != len(axes):
        raise ctx.unsupported(f"scales {scales} need one entry per axis {axes}")
    full_scales = [1.0] * rank
    for a, s in zip(axes, scales):
        if s <= 0:
            raise ctx.unsupported(f"scale {s} must be positive")
        full_scales[a] = float(s)
    return full_scales, [int(np.floor(d * s)) for d, s in zip(in_shape, full_scales)]


def _mode(ctx) -> str:
    mode = ctx.attr("mode", "nearest")
    if mode not in ("nearest", "linear", "bilinear", "trilinear"):
        raise ctx.unsupported(f"mode={mode!r} is not supported (nearest and linear are)")
    return "nearest" if mode == "nearest" else "linear"


@register("Resize", attributes=["mode", "coordinate_transformation_mode", "nearest_mode", "cubic_coeff_a",
                                "exclude_outside", "extrapolation_value", "antialias", "axes",
                                "keep_aspect_ratio_policy"])
def lower_resize(ctx):
    x = ctx.tensor(0)
    mode = _mode(ctx)
    if ctx.attr("antialias", 0):
        raise ctx.unsupported("antialias=1 is not supported")
    if ctx.opset < 11:
        coordinates, nearest_mode = "asymmetric", "simple"
        scales, sizes = [float(v) for v in ctx.const(1, "scales").reshape(-1)], None
    else:
        coordinates = ctx.attr("coordinate_transformation_mode", "half_pixel")
        nearest_mode = ctx.attr("nearest_mode", "round_prefer_floor")
        if coordinates not in COORDINATE_MODES:
            raise ctx.unsupported(f"coordinate_transformation_mode={coordinates!r} is not supported")
        if nearest_mode not in NEAREST_MODES[:4]:
            raise ctx.unsupported(f"nearest_mode={nearest_mode!r} is not supported")
        scales = ([float(v) for v in ctx.const(2, "scales").reshape(-1)]
                  if ctx.has(2) and ctx.const(2, "scales").size else None)
        sizes = ([int(v) for v in ctx.const(3, "sizes").reshape(-1)]
                 if ctx.has(3) and ctx.const(3, "sizes").size else None)
    scales, out_shape = _scales_and_shape(ctx, x, scales, sizes, ctx.attr("axes"))
    return [resize(ctx, x, scales, out_shape, mode, coordinates, nearest_mode)]


@register("Upsample", attributes=["mode", "scales", "width_scale", "height_scale"])
def lower_upsample(ctx):
    """Resize's predecessor (opsets 7-9): asymmetric coordinates, scales as attribute (7) or input (9)."""
    x = ctx.tensor(0)
    mode = _mode(ctx)
    if "scales" in ctx.attrs:
        scales = [float(v) for v in ctx.attr("scales")]
    elif "height_scale" in ctx.attrs:  # opset 1: 4-D only
        scales = [1.0, 1.0, float(ctx.attr("height_scale")), float(ctx.attr("width_scale"))]
    else:
        scales = [float(v) for v in ctx.const(1, "scales").reshape(-1)]
    scales, out_shape = _scales_and_shape(ctx, x, scales, None, None)
    return [resize(ctx, x, scales, out_shape, mode, "asymmetric", "simple")]


@register("DepthToSpace", attributes=["blocksize", "mode"])
def lower_depth_to_space(ctx):
    x = ctx.tensor(0)
    if x.ndim != 4:
        raise ctx.unsupported(f"input of rank {x.ndim}: DepthToSpace needs NCHW")
    b = int(ctx.attr("blocksize"))
    n, c, h, w = shape_of(x)
    mode = ctx.attr("mode", "DCR")
    if c % (b * b) or mode not in ("DCR", "CRD"):
        raise ctx.unsupported(f"{c} channels with blocksize {b}, mode {mode!r}")
    oc = c // (b * b)

    def body(i, j, y, z):
        by, bx = tirx.floormod(y, b), tirx.floormod(z, b)
        channel = (by * b + bx) * oc + j if mode == "DCR" else j * b * b + by * b + bx
        return x(i, channel, tirx.floordiv(y, b), tirx.floordiv(z, b))

    return [te.compute((n, oc, h * b, w * b), body, name="depth_to_space")]


@register("SpaceToDepth", attributes=["blocksize", "mode"])
def lower_space_to_depth(ctx):
    x = ctx.tensor(0)
    b = int(ctx.attr("blocksize"))
    mode = ctx.attr("mode", "DCR")
    if x.ndim != 4 or shape_of(x)[2] % b or shape_of(x)[3] % b or mode not in ("DCR", "CRD"):
        raise ctx.unsupported(f"input {list(shape_of(x))} is not NCHW divisible by blocksize {b} (mode {mode!r})")
    n, c, h, w = shape_of(x)

    def body(i, j, y, z):
        if mode == "DCR":
            block, channel = tirx.floordiv(j, c), tirx.floormod(j, c)
        else:
            block, channel = tirx.floormod(j, b * b), tirx.floordiv(j, b * b)
        return x(i, channel, y * b + tirx.floordiv(block, b), z * b + tirx.floormod(block, b))

    return [te.compute((n, c * b * b, h // b, w // b), body, name="space_to_depth")]

