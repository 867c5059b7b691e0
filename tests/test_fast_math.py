"""codegen/fast_math.py: libm calls become vectorizable polynomials with float32-level accuracy."""

import math

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import te, tirx

from souffle_py.codegen.fast_math import fast_math
from souffle_py.schedule.default import schedule_cpu
from souffle_py.target import resolve_target

N = 4096
ERF = np.vectorize(math.erf)
CASES = {
    "exp": (tirx.exp, np.exp),
    "erf": (tirx.erf, ERF),
    "tanh": (tirx.tanh, np.tanh),
    "sigmoid": (tirx.sigmoid, lambda v: 1.0 / (1.0 + np.exp(-v))),
    "gelu": (lambda v: v * 0.5 * (tirx.erf(v / np.float32(math.sqrt(2.0))) + 1.0),
             lambda v: v * 0.5 * (ERF(v / math.sqrt(2.0)) + 1.0)),
    "nested": (lambda v: tirx.exp(tirx.tanh(v)), lambda v: np.exp(np.tanh(v))),
    "silu": (lambda v: v * tirx.sigmoid(v), lambda v: v / (1.0 + np.exp(-v))),
}


def _func(expr):
    x = te.placeholder((N,), "float32", name="x")
    return te.create_prim_func([x, te.compute((N,), lambda i: expr(x[i]), name="y")])


def _intrinsics(func) -> set[str]:
    names = set()

    def visit(call):
        if isinstance(call.op, tvm.ir.Op):
            names.add(call.op.name)

    tvm_ffi.structural_walk(func, [(tvm.ir.Call, visit)])
    return names & {"tirx.exp", "tirx.erf", "tirx.tanh", "tirx.sigmoid"}


@pytest.mark.parametrize("name", CASES)
def test_approximations_replace_the_calls_and_match_float64(name):
    expr, reference = CASES[name]
    assert _intrinsics(_func(expr))
    func = fast_math(_func(expr))
    assert not _intrinsics(func)
    lib = tvm.compile(schedule_cpu(func), target=resolve_target("llvm"))
    x = np.concatenate([np.linspace(-20, 20, N // 2), np.random.default_rng(0).standard_normal(N // 2) * 3])
    x = x.astype(np.float32)
    y = tvm.runtime.tensor(np.zeros(N, np.float32))
    lib["main"](tvm.runtime.tensor(x), y)
    expected = reference(x.astype(np.float64))
    np.testing.assert_allclose(y.numpy(), expected, rtol=2e-6, atol=2e-6)


def test_silu_divides_once_instead_of_multiplying_by_a_reciprocal():
    divisions = []
    tvm_ffi.structural_walk(fast_math(_func(CASES["silu"][0])), [(tirx.Div, divisions.append)])
    assert len(divisions) == 1
    assert not isinstance(divisions[0].a, tirx.FloatImm)  # x / (1 + exp(-x)), not x * (1 / (1 + exp(-x)))


def test_other_dtypes_keep_the_exact_call():
    x = te.placeholder((N,), "float64", name="x")
    func = te.create_prim_func([x, te.compute((N,), lambda i: tirx.exp(x[i]), name="y")])
    assert _intrinsics(fast_math(func)) == {"tirx.exp"}


def test_optimize_exact_math_keeps_the_libm_calls():
    import souffle_py
    from models.registry import build_model

    proto = build_model("bert", tiny=True, layers=1)
    fast = souffle_py.optimize(proto, quiet=True)
    exact = souffle_py.optimize(proto, quiet=True, fast_math=False)
    assert not any(_intrinsics(k.func) for k in fast.kernels)
    assert any(_intrinsics(k.func) for k in exact.kernels)
    feeds = fast.random_feeds()
    for name, value in exact.run(feeds).items():
        np.testing.assert_allclose(fast.run(feeds)[name], value, rtol=1e-4, atol=1e-5)
