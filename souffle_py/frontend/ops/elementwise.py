"""Elementwise operators with numpy broadcasting: arithmetic, comparisons, activations, Where, Cast."""

from __future__ import annotations

import numpy as np
from tvm import te, tirx, topi

from souffle_py.frontend.context import register
from souffle_py.frontend.ops.ieee import maximum, minimum, nonzero, relu
from souffle_py.frontend.ops.util import (SUPPORTED_DTYPES, broadcast_shape, dtype_of, elementwise, onnx_dtype, operand,
                                         value_shape)


def _binary(fn, name):
    def rule(ctx):
        if ctx.opset < 7 and ctx.attr("broadcast", 0):
            return [_legacy_broadcast(ctx, fn, name)]
        shape = broadcast_shape(ctx.shape(0), ctx.shape(1))
        a, b = operand(ctx, 0, len(shape)), operand(ctx, 1, len(shape))
        return [elementwise([a, b], shape, fn, name)]
    return rule


def _legacy_broadcast(ctx, fn, name):
    """Opsets 1-6: B broadcasts to A's shape with its axes placed from `axis` on (default: the trailing ones)."""
    a_shape, b_shape = ctx.shape(0), ctx.shape(1)
    axis = ctx.attr("axis", len(a_shape) - len(b_shape))
    if not 0 <= axis <= len(a_shape) - len(b_shape) or any(
            d not in (1, a_shape[axis + i]) for i, d in enumerate(b_shape)):
        raise ctx.unsupported(f"B of shape {list(b_shape)} does not broadcast to A's {list(a_shape)} at axis {axis}")
    aligned = (1,) * axis + tuple(b_shape) + (1,) * (len(a_shape) - axis - len(b_shape))
    b = operand(ctx, 1, len(a_shape))
    if isinstance(b, te.Tensor) and aligned != tuple(b_shape):
        b = (ctx.new_param(ctx.const(1).reshape(aligned), f"{ctx.node.input[1]}_aligned") if ctx.is_const(1)
             else topi.reshape(b, aligned))
    return elementwise([operand(ctx, 0, len(a_shape)), b], a_shape, fn, name)


def _xor(a, b):
    """a != b for bools, spelled with And/Or/Not: TVM's LLVM codegen emits a float compare for bool != bool."""
    return tirx.any(tirx.all(a, tirx.Not(b)), tirx.all(tirx.Not(a), b))


def _div(a, b):
    return a / b if dtype_of(a).startswith("float") else tirx.truncdiv(a, b)


BINARY = {
    "Add": (lambda a, b: a + b, "add"),
    "Sub": (lambda a, b: a - b, "sub"),
    "Mul": (lambda a, b: a * b, "mul"),
    "Div": (_div, "div"),
    "Equal": (lambda a, b: tirx.Not(_xor(a, b)) if dtype_of(a) == "bool" else a == b, "equal"),
    "Less": (lambda a, b: a < b, "less"),
    "Greater": (lambda a, b: a > b, "greater"),
    "LessOrEqual": (lambda a, b: a <= b, "less_equal"),
    "GreaterOrEqual": (lambda a, b: a >= b, "greater_equal"),
    "And": (tirx.all, "and"),
    "Or": (tirx.any, "or"),
    "Xor": (lambda a, b: _xor(a, b), "xor"),
    "BitwiseAnd": (tirx.bitwise_and, "bitwise_and"),
    "BitwiseOr": (tirx.bitwise_or, "bitwise_or"),
    "BitwiseXor": (tirx.bitwise_xor, "bitwise_xor"),
}
for _op, (_fn, _name) in BINARY.items():
    register(_op, attributes=["broadcast", "axis"])(_binary(_fn, _name))  # attributes of opsets < 7


@register("Pow")
def lower_pow(ctx):
    """x ** y; the common constant exponents become multiplications or sqrt (exact and much cheaper)."""
    shape = broadcast_shape(ctx.shape(0), ctx.shape(1))
    base = operand(ctx, 0, len(shape))
    if ctx.is_const(1) and ctx.const(1).size == 1 and ctx.const(1).ndim <= len(shape):
        exponent = float(ctx.const(1).reshape(-1)[0])
        special = {1.0: lambda x: x, 2.0: lambda x: x * x, 3.0: lambda x: x * x * x, 0.5: tirx.sqrt}
        if exponent in special:
            return [elementwise([base], shape, special[exponent], "pow")]
    exponent = operand(ctx, 1, len(shape))

    def power(x, y):
        if not dtype_of(x).startswith("float"):  # integer bases: float64 power, truncated back
            return tirx.power(x.astype("float64"), y.astype("float64")).astype(dtype_of(x))
        return tirx.power(x, y if dtype_of(y) == dtype_of(x) else y.astype(dtype_of(x)))

    return [elementwise([base, exponent], shape, power, "pow")]


UNARY = {
    "Relu": relu,
    "Sigmoid": tirx.sigmoid,
    "Tanh": tirx.tanh,
    "Erf": tirx.erf,
    "Sqrt": tirx.sqrt,
    "Exp": tirx.exp,
    "Log": tirx.log,
    "Abs": tirx.abs,
    "Neg": lambda x: -x,
    "Reciprocal": lambda x: tirx.const(1, dtype_of(x)) / x,
    "Floor": tirx.floor,
    "Ceil": tirx.ceil,
    "Not": lambda x: tirx.Not(x),
    "BitwiseNot": tirx.bitwise_not,
    "Round": tirx.nearbyint,  # half to even, as ONNX rounds
    "IsNaN": tirx.isnan,
    **{op: getattr(tirx, op.lower()) for op in ("Cos", "Sin", "Tan", "Acos", "Asin", "Atan",
                                                  "Acosh", "Asinh", "Atanh")},
    # from exp, as TVM legalizes them for scalars: TVM 0.27's LLVM backend has no vector tirx.sinh/cosh,
    # and an elementwise loop of any shape may be vectorized (schedule/flat.py)
    "Sinh": lambda x: (tirx.exp(x) - tirx.exp(-x)) * tirx.const(0.5, dtype_of(x)),
    "Cosh": lambda x: (tirx.exp(x) + tirx.exp(-x)) * tirx.const(0.5, dtype_of(x)),
}
ANY_DTYPE = ("Abs", "Neg", "Not", "Relu", "BitwiseNot")


def _unary(op_type, fn):
    def rule(ctx):
        x = ctx.tensor(0)
        if op_type not in ANY_DTYPE and not dtype_of(x).startswith("float"):
            raise ctx.unsupported(f"input '{ctx.node.input[0]}' has dtype {dtype_of(x)}; a floating-point type is needed")
        return [elementwise([x], value_shape(x), fn, op_type.lower())]
    return rule


for _op, _fn in UNARY.items():
    register(_op)(_unary(_op, _fn))


@register("Mod", attributes=["fmod"])
def lower_mod(ctx):
    """fmod=0: the remainder takes the divisor's sign (integers only, like Python's %); fmod=1: C's fmod."""
    shape = broadcast_shape(ctx.shape(0), ctx.shape(1))
    a, b = operand(ctx, 0, len(shape)), operand(ctx, 1, len(shape))
    is_float = dtype_of(a).startswith("float")
    if is_float:
        fn = _fmod if ctx.attr("fmod", 0) else _float_floor_mod
    else:
        fn = tirx.truncmod if ctx.attr("fmod", 0) else tirx.floormod
    return [elementwise([a, b], shape, fn, "mod")]


def _wide(a, b):
    """a and b in the type fmod is computed in: their own, float16 widened to float32 (exact either way)."""
    wide = "float32" if dtype_of(a) == "float16" else dtype_of(a)
    return a.astype(wide), b.astype(wide)


def _fmod(a, b):
    """fmod=1: C's fmod, exact for any quotient (LLVM's frem, a libm fmod call; x - trunc(x / y) * y in
    float64 lost every digit once x / y passed 2^53: fmod(3e38, 0.9) gave 9e21)."""
    return tirx.truncmod(*_wide(a, b)).astype(dtype_of(a))


def _float_floor_mod(a, b):
    """numpy's float %: C's fmod moved by one divisor where its sign differs from the divisor's."""
    x, y = _wide(a, b)
    r = tirx.truncmod(x, y)
    zero = tirx.const(0.0, dtype_of(x))
    return tirx.Select(tirx.all(r != zero, _xor(r < zero, y < zero)), r + y, r).astype(dtype_of(a))


@register("BitShift", attributes=["direction"])
def lower_bit_shift(ctx):
    shape = broadcast_shape(ctx.shape(0), ctx.shape(1))
    direction = ctx.attr("direction")
    if direction not in ("LEFT", "RIGHT"):
        raise ctx.unsupported(f"direction={direction!r} (LEFT or RIGHT)")
    shift = tirx.shift_left if direction == "LEFT" else tirx.shift_right

    def fn(a, b):  # out-of-range shifts: every bit shifted out (C leaves them undefined)
        bits = tirx.const(int("".join(c for c in dtype_of(a) if c.isdigit())), dtype_of(b))
        zero = tirx.const(0, dtype_of(a))
        out = zero
        if direction == "RIGHT" and not dtype_of(a).startswith("uint"):  # arithmetic: the sign fills in
            out = tirx.Select(a < zero, tirx.const(-1, dtype_of(a)), zero)
        return tirx.Select(tirx.any(b >= bits, b < tirx.const(0, dtype_of(b))), out, shift(a, b))

    return [elementwise([operand(ctx, 0, len(shape)), operand(ctx, 1, len(shape))], shape, fn, "bit_shift")]


@register("IsInf", attributes=["detect_negative", "detect_positive"])
def lower_is_inf(ctx):
    x = ctx.tensor(0)
    if not dtype_of(x).startswith("float"):
        raise ctx.unsupported(f"input dtype {dtype_of(x)} (floating point only)")
    negative, positive = ctx.attr("detect_negative", 1), ctx.attr("detect_positive", 1)
    zero = tirx.const(0, dtype_of(x))

    def fn(v):
        inf = tirx.isinf(v)
        if negative and positive:
            return inf
        if not negative and not positive:
            return tirx.const(False, "bool")
        return tirx.all(inf, v > zero if positive else v < zero)

    return [elementwise([x], value_shape(x), fn, "is_inf")]


@register("Where")
def lower_where(ctx):
    shape = broadcast_shape(ctx.shape(0), ctx.shape(1), ctx.shape(2))
    args = [operand(ctx, i, len(shape)) for i in range(3)]
    return [elementwise(args, shape, lambda c, x, y: tirx.Select(c, x, y), "where")]


@register("Cast", attributes=["to", "saturate"])
@register("CastLike", attributes=["saturate"])
def lower_cast(ctx):
    """Cast to `to` (CastLike: to input 1's dtype); float to bool is `!= 0`, as numpy does (NaN is true)."""
    dtype = onnx_dtype(ctx.attr("to")) if ctx.op_type == "Cast" else ctx.dtype(1)
    if dtype not in SUPPORTED_DTYPES:
        raise ctx.unsupported(f"casting to {dtype} is not supported")
    x = ctx.tensor(0)
    if dtype == dtype_of(x):
        return [x]
    if dtype == "bool":
        return [elementwise([x], value_shape(x), nonzero, "cast")]
    return [elementwise([x], value_shape(x), lambda v: v.astype(dtype), "cast")]


@register("Identity")
def lower_identity(ctx):
    return [ctx.value(0)]


@register("Dropout", attributes=["seed", "ratio", "is_test"])
def lower_dropout(ctx):
    """Inference: the identity in every opset form (ratio as an attribute before opset 12, an input since;
    is_test before opset 7). training_mode, when given, must be a constant false."""
    if ctx.has(2) and bool(np.asarray(ctx.const(2, "training_mode")).reshape(-1)[0]):
        raise ctx.unsupported("training_mode=True is not supported (inference only)")
    x = ctx.value(0)
    mask_dtype = bool if ctx.opset >= 10 else np.dtype(dtype_of(x))
    return [x, np.ones(value_shape(x), dtype=mask_dtype)]


def _variadic(combine, name, mean=False):
    """Min/Max/Sum/Mean: every input broadcast to the common shape, folded left to right."""

    def rule(ctx):
        shapes = [ctx.shape(i) for i in range(ctx.num_inputs)]
        shape = broadcast_shape(*shapes)
        args = [operand(ctx, i, len(shape)) for i in range(ctx.num_inputs)]
        if mean and not dtype_of(args[0]).startswith("float"):
            raise ctx.unsupported(f"Mean of dtype {dtype_of(args[0])} is not supported (floating point only)")
        if len(args) == 1 and isinstance(args[0], te.Tensor):
            return [args[0]]

        def fold(*values):
            out = values[0]
            for v in values[1:]:
                out = combine(out, v)
            return out * tirx.const(1 / len(values), dtype_of(out)) if mean else out

        return [elementwise(args, shape, fold, name)]

    return rule


register("Max")(_variadic(maximum, "max"))
register("Min")(_variadic(minimum, "min"))
register("Sum")(_variadic(lambda a, b: a + b, "sum"))
register("Mean")(_variadic(lambda a, b: a + b, "mean", mean=True))
