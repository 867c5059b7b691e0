"""Activations with parameters: Clip, LeakyRelu, PRelu, Elu, Selu, Celu, ThresholdedRelu, HardSigmoid,
HardSwish, Softplus, Mish, Swish, Softsign, Gelu, Shrink, Sign. Each is one elementwise TE; constant bounds and slopes
become immediates so the TE reads nothing but its input."""

from __future__ import annotations

import numpy as np
from tvm import tirx, topi

from souffle_py.frontend.context import register
from souffle_py.frontend.ops.ieee import at_least, at_most, keep_nan, relu
from souffle_py.frontend.ops.util import dtype_of, elementwise, operand, value_shape


def _const(x, value):
    return tirx.const(value, dtype_of(x))


def _float_input(ctx):
    x = ctx.tensor(0)
    if not dtype_of(x).startswith("float"):
        raise ctx.unsupported(f"input '{ctx.node.input[0]}' has dtype {dtype_of(x)}; a floating-point type is needed")
    return x


def _activation(op_type, attributes, fn):
    """Register `fn(x, attr) -> expr` as the rule of a unary activation with float attributes."""

    def rule(ctx):
        x = _float_input(ctx)
        params = {name: float(ctx.attr(name, default)) for name, default in attributes.items()}
        return [elementwise([x], value_shape(x), lambda v: fn(v, params), op_type.lower())]

    register(op_type, attributes=list(attributes))(rule)


def _select(cond, a, b):
    return tirx.Select(cond, a, b)


_activation("LeakyRelu", {"alpha": 0.01},
            lambda x, p: _select(x >= _const(x, 0), x, x * _const(x, p["alpha"])))
_activation("Elu", {"alpha": 1.0},
            lambda x, p: _select(x >= _const(x, 0), x, _const(x, p["alpha"]) * (tirx.exp(x) - _const(x, 1))))
_activation("Celu", {"alpha": 1.0},
            lambda x, p: relu(x) + at_most(
                _const(x, p["alpha"]) * (tirx.exp(x / _const(x, p["alpha"])) - _const(x, 1)), _const(x, 0)))
_activation("Selu", {"alpha": 1.67326319217681884765625, "gamma": 1.05070102214813232421875},
            lambda x, p: _const(x, p["gamma"]) * _select(
                x > _const(x, 0), x, _const(x, p["alpha"]) * (tirx.exp(x) - _const(x, 1))))
_activation("ThresholdedRelu", {"alpha": 1.0},
            lambda x, p: _select(x > _const(x, p["alpha"]), x, _const(x, 0)))
_activation("HardSigmoid", {"alpha": 0.2, "beta": 0.5},
            lambda x, p: at_least(at_most(x * _const(x, p["alpha"]) + _const(x, p["beta"]), _const(x, 1)),
                                  _const(x, 0)))
_activation("HardSwish", {},
            lambda x, p: x * at_least(at_most(x * _const(x, 1 / 6) + _const(x, 0.5), _const(x, 1)), _const(x, 0)))
_activation("Softsign", {}, lambda x, p: x / (_const(x, 1) + tirx.abs(x)))
_activation("Shrink", {"bias": 0.0, "lambd": 0.5},
            lambda x, p: _select(x < _const(x, -p["lambd"]), x + _const(x, p["bias"]),
                                 _select(x > _const(x, p["lambd"]), x - _const(x, p["bias"]), _const(x, 0))))


def _softplus(x, p):
    """log(1 + exp(x)), written to neither overflow for large x nor lose small results for very negative x."""
    return relu(x) + tirx.log(_const(x, 1) + tirx.exp(-tirx.abs(x)))


_activation("Softplus", {}, _softplus)
_activation("Mish", {}, lambda x, p: x * tirx.tanh(_softplus(x, p)))
_activation("Swish", {"alpha": 1.0}, lambda x, p: x * tirx.sigmoid(x * _const(x, p["alpha"])))


@register("Gelu", attributes=["approximate"])
def lower_gelu(ctx):
    x = _float_input(ctx)
    approximate = ctx.attr("approximate", "none")
    if approximate == "none":
        fn = lambda v: _const(v, 0.5) * v * (_const(v, 1) + tirx.erf(v * _const(v, 1 / np.sqrt(2))))  # noqa: E731
    elif approximate == "tanh":
        fn = lambda v: _const(v, 0.5) * v * (_const(v, 1) + tirx.tanh(  # noqa: E731
            _const(v, np.sqrt(2 / np.pi)) * (v + _const(v, 0.044715) * v * v * v)))
    else:
        raise ctx.unsupported(f"approximate={approximate!r} is not supported")
    return [elementwise([x], value_shape(x), fn, "gelu")]


@register("Sign")
def lower_sign(ctx):
    x = ctx.tensor(0)
    zero, one = _const(x, 0), _const(x, 1)
    return [elementwise([x], value_shape(x),
                        lambda v: _select(v > zero, one, _select(v < zero, -one, keep_nan(v, zero))), "sign")]


@register("Clip", attributes=["min", "max"])
def lower_clip(ctx):
    """min(max(x, lo), hi), NaN staying NaN; the bounds are attributes before opset 11 and optional scalar
    inputs since. A float bound not given is the dtype's lowest / largest finite value, as the spec and ONNX
    Runtime have it (so Clip without bounds turns +-inf into +-3.4e38)."""
    x = ctx.tensor(0)
    shape = value_shape(x)
    bounds = []
    is_float = dtype_of(x).startswith("float")
    for index, attr, combine, extreme in ((1, "min", at_least, "min"), (2, "max", at_most, "max")):
        if ctx.opset < 11 and attr in ctx.attrs:
            bounds.append((_const(x, float(ctx.attr(attr))), combine))
        elif ctx.opset >= 11 and ctx.has(index):
            if ctx.shape(index) not in ((), (1,)):
                raise ctx.unsupported(f"{attr} must be a scalar, got shape {list(ctx.shape(index))}")
            bounds.append((operand(ctx, index, max(len(shape), 1)), combine))
        elif is_float:
            bounds.append((_const(x, float(getattr(np.finfo(dtype_of(x)), extreme))), combine))
    inputs = [x] + [b for b, _ in bounds]

    def clip(v, *limits):
        for limit, (_, combine) in zip(limits, bounds):
            v = combine(v, limit)
        return v

    return [elementwise(inputs, shape, clip, "clip")]


@register("PRelu")
def lower_prelu(ctx):
    """x where x >= 0, else slope * x; slope broadcasts to x (before opset 7: a per-channel slope of size C)."""
    x = _float_input(ctx)
    shape = value_shape(x)
    slope_shape = ctx.shape(1)
    if ctx.opset < 7 and len(shape) >= 2 and slope_shape == (shape[1],) and shape[1] > 1:
        per_channel = (shape[1],) + (1,) * (len(shape) - 2)
        slope = (ctx.new_param(ctx.const(1).reshape(per_channel), f"{ctx.node.input[1]}_per_channel")
                 if ctx.is_const(1) else topi.reshape(ctx.tensor(1), per_channel))
    elif len(slope_shape) <= len(shape) and all(d in (1, x_d) for d, x_d in
                                                zip(reversed(slope_shape), reversed(shape))):
        slope = operand(ctx, 1, len(shape))
    else:
        raise ctx.unsupported(f"slope of shape {list(slope_shape)} does not broadcast to {list(shape)}")
    return [elementwise([x, slope], shape, lambda v, s: _select(v >= _const(v, 0), v, v * s), "prelu")]
