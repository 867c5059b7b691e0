"""Pooling: MaxPool, AveragePool (topi.nn.pool1d/2d/3d) and the global pools (one reduction TE each).

topi's pools implement ONNX's ceil_mode rule that a window starting in the right padding is dropped, as
ONNX Runtime and onnx's reference do; ONNX shape inference keeps that window, so such nodes are rejected
rather than given a shape that half the ONNX world disagrees with.
"""

from __future__ import annotations

import numpy as np
from tvm import tirx, topi

from souffle_py.frontend.context import register
from souffle_py.frontend.ops.conv import conv_geometry
from souffle_py.frontend.ops.ieee import with_maximum
from souffle_py.frontend.ops.reduce import reduce
from souffle_py.frontend.ops.util import dtype_of, shape_of

TOPI_POOL = {1: (topi.nn.pool1d, "NCW"), 2: (topi.nn.pool2d, "NCHW"), 3: (topi.nn.pool3d, "NCDHW")}
POOL_ATTRIBUTES = ["auto_pad", "ceil_mode", "dilations", "kernel_shape", "pads", "strides"]


def _pool(ctx, kind: str, count_include_pad: bool = False):
    x = ctx.tensor(0)
    dims = x.ndim - 2
    if dims not in TOPI_POOL:
        raise ctx.unsupported(f"{dims}-D pooling is not supported (1-D to 3-D are)")
    if kind == "avg" and not dtype_of(x).startswith("float"):
        raise ctx.unsupported(f"input dtype {dtype_of(x)} is not supported (floating point only)")
    kernel = list(ctx.attr("kernel_shape"))
    in_spatial = shape_of(x)[2:]
    strides, dilations, begin, end = conv_geometry(ctx, in_spatial, kernel)
    ceil_mode = bool(ctx.attr("ceil_mode", 0))
    if ceil_mode:
        for size, k, s, d, b, e in zip(in_spatial, kernel, strides, dilations, begin, end):
            last_start = -(-(size + b + e - (k - 1) * d - 1) // s) * s
            if last_start >= size + b:
                raise ctx.unsupported("ceil_mode with a last window that starts in the right padding: ONNX shape "
                                      "inference keeps that window, ONNX Runtime and the spec drop it")
    pool, layout = TOPI_POOL[dims]
    out = pool(x, kernel, strides, dilations, begin + end, kind, ceil_mode, layout, count_include_pad)
    return with_maximum(out) if kind == "max" and dtype_of(x).startswith("float") else out


@register("MaxPool", attributes=POOL_ATTRIBUTES + ["storage_order"])
def lower_max_pool(ctx):
    """storage_order only concerns the Indices output, which is not supported."""
    if len(ctx.node.output) > 1 and ctx.node.output[1]:
        raise ctx.unsupported("the Indices output is not supported")
    return [_pool(ctx, "max")]


@register("AveragePool", attributes=POOL_ATTRIBUTES + ["count_include_pad"])
def lower_average_pool(ctx):
    return [_pool(ctx, "avg", bool(ctx.attr("count_include_pad", 0)))]


def _global_pool(kind: str):
    def rule(ctx):
        x = ctx.tensor(0)
        axes = list(range(2, x.ndim))
        if kind == "max":
            return [reduce(x, axes, True, "max", "global_max_pool")]
        scale = tirx.const(1.0 / int(np.prod(shape_of(x)[2:])), dtype_of(x))
        return [reduce(x, axes, True, "sum", "global_avg_pool", lambda v, idx: v * scale)]
    return rule


register("GlobalAveragePool")(_global_pool("avg"))
register("GlobalMaxPool")(_global_pool("max"))
