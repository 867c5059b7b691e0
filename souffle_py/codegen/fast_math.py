"""Fast float32 exp, erf, tanh and sigmoid: topi's polynomial approximations instead of libm calls.

LLVM lowers tirx.exp/erf/tanh to scalar expf/erff calls that do not vectorize: on BERT-base the GELU's erf
alone took 15 of 86 ms per inference, ~100x topi.fast_erf's vectorized polynomial (relative error ~3e-7;
fast_exp ~1e-7, fast_tanh ~3e-7; ONNX Runtime's MLAS uses the same kind of approximation). The rewrite is
applied to kernels' PrimFuncs, so the analysis and the TE passes still see the intrinsics (which their cost
model counts as expensive, never to be recomputed).

Out-of-range inputs follow the approximations: exp saturates at exp(+-88.38) (finite, ~2.4e38 / ~4e-39) and
tanh at +-1 from |x| >= 9; x * sigmoid(y) is computed as x / (1 + exp(-y)). NaN stays NaN (their
clamps are written constant first, which keeps NaN). `optimize(fast_math=False)` keeps the exact libm
calls.
"""

from __future__ import annotations

import functools

import tvm
import tvm_ffi
from tvm import te, tirx, topi

from souffle_py.ir.graph import map_loads

APPROXIMATIONS = {"tirx.exp": topi.fast_exp, "tirx.erf": topi.fast_erf, "tirx.tanh": topi.fast_tanh}
SIGMOID = "tirx.sigmoid"


@functools.cache
def _template(op_name: str):
    """(var, expression of var) computing op_name with topi's approximation, for float32, its clamps
    written to keep NaN."""
    x = te.placeholder((1,), "float32", name="x")
    var = tirx.Var("v", "float32")
    return var, _nan_keeping_clamps(_inline(APPROXIMATIONS[op_name](x), var))


def _nan_keeping_clamps(expr):
    """Every max/min against a constant with the constant first. TVM lowers float max(a, b) to
    `a > b ? a : b` (min alike), which returns b when either is NaN: topi's clamp `max(min(v, hi), lo)` turns
    NaN into a bound (erf(NaN) = 1), `max(lo, min(hi, v))` keeps it, at no cost (a guard `isnan(v) ? v : ...`
    around the approximation cost EfficientNet-b0's SiLUs 18.1 against 10.7 ms per inference)."""
    def swap(node, kind):
        if isinstance(node.b, (tirx.FloatImm, tirx.IntImm)) and not isinstance(node.a, (tirx.FloatImm, tirx.IntImm)):
            return kind(node.b, node.a)
        return node
    return tvm_ffi.structural_map(expr, [(tirx.Max, lambda n: swap(n, tirx.Max)),
                                         (tirx.Min, lambda n: swap(n, tirx.Min))])


def _inline(tensor: te.Tensor, var):
    """The elementwise TE chain ending at `tensor` as one expression of its placeholder's value `var`
    (fast_tanh clamps its input in a stage of its own)."""
    if isinstance(tensor.op, te.PlaceholderOp):
        return var
    body = tensor.op.body[int(tensor.value_index)]
    return map_loads(body, lambda producer, indices: _inline(producer, var))


def _approximate(op_name: str, arg):
    """The approximation of op_name(arg); NaN in, NaN out (its clamps keep NaN: `_nan_keeping_clamps`)."""
    var, expr = _template(op_name)
    fresh = tirx.Var("v", "float32")  # a fresh binding per use keeps nested rewrites (exp(erf(x))) distinct
    return tirx.Let(fresh, arg, _substitute(expr, var, fresh))


def _substitute(expr, old, new):
    return tvm_ffi.structural_map(expr, [(tirx.Var, lambda v: new if v.same_as(old) else v)])


def _rewrite(call):
    if not isinstance(call.op, tvm.ir.Op) or str(call.ty) != "float32":
        return call
    name = call.op.name
    if name in APPROXIMATIONS:
        return _approximate(name, call.args[0])
    if name == SIGMOID:
        one = tirx.const(1.0, "float32")
        return one / (one + _approximate("tirx.exp", -call.args[0]))
    return call


def _is_one(expr) -> bool:
    return isinstance(expr, tirx.FloatImm) and expr.value == 1.0


def _fold_reciprocal(mul):
    """x * (1 / d) -> x / d: the SiLU x * sigmoid(x) then costs one division and no multiply (EfficientNet-b0's
    BN + SiLU passes over 96 x 112 x 112: 0.298 -> 0.269 ms; the results differ by at most an ulp)."""
    if str(mul.ty) != "float32":
        return mul
    for x, reciprocal in ((mul.a, mul.b), (mul.b, mul.a)):
        if isinstance(reciprocal, tirx.Div) and _is_one(reciprocal.a):
            return tirx.Div(x, reciprocal.b)
    return mul


def fast_math(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` with every float32 exp/erf/tanh/sigmoid call replaced by its vectorizable approximation."""
    # one pass, children first: a product sees its sigmoid already rewritten to 1 / (1 + exp(-x))
    return tvm_ffi.structural_map(func, [(tvm.ir.Call, _rewrite), (tirx.Mul, _fold_reciprocal)])


def fresh_lets(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` (scheduled) with each store's Let bindings on variables of their own, and the Lets under a
    float max / min substituted away. The approximations bind a Let variable per call, but a schedule that
    inlines one stage into two (a quantized softmax's exp, read by its row sum and by its normalization)
    copies the binding, and TVM lowers a float max(a, b) to `a > b ? a : b`, copying `a` (a quantized
    value's saturation, te_passes/quant.py, clamps the approximation's result): TVM's lowering then
    refuses one variable bound to two values in one function. The substituted value is an approximation's
    argument (a few loads and operations), which LLVM's common-subexpression elimination merges again."""
    def store(node):
        lets = []
        tvm_ffi.structural_walk(node.value, [(tirx.Let, lets.append)])
        if not lets:
            return node
        value = tvm_ffi.structural_map(node.value, [(tirx.Max, _without_lets), (tirx.Min, _without_lets)])
        value = tvm_ffi.structural_map(value, [(tirx.Let, _renamed)])
        return tirx.BufferStore(node.buffer, value, list(node.indices))

    return tvm_ffi.structural_map(func, [(tirx.BufferStore, store)])


def _without_lets(node):
    """A max / min with the Lets in its operands substituted (their variables replaced by their values)."""
    lets = []
    tvm_ffi.structural_walk(node, [(tirx.Let, lets.append)])
    if not lets:
        return node
    return tvm_ffi.structural_map(node, [(tirx.Let, lambda let: _substitute(let.body, let.var, let.value))])


def _renamed(let):
    value = let.value
    fresh = tirx.Var(let.var.name, str(value.dtype) if hasattr(value, "dtype") else str(value.ty))
    return tirx.Let(fresh, let.value, _substitute(let.body, let.var, fresh))
