"""codegen/scalar_order.py and codegen/vector_rounding.py: the two changes to a merged kernel's code that
dynamically quantized models needed. A one-value stage (a scale) computed after a GEMM moves up to just
after what it reads, so that the GEMM's epilogue reading it can run in the GEMM's write-back; nearbyint is
vectorized (round half to even, as before) instead of scalarized, and a saturating quantization rounds as it
converts (vcvtps2dq)."""

import re

import numpy as np
import pytest
import tvm
from tvm import s_tir, te, tirx

from souffle_py.codegen.kernels import kernel_func
from souffle_py.codegen.scalar_order import scalars_early
from souffle_py.codegen.stack_locals import PIPELINE
from souffle_py.codegen.vector_rounding import vector_rounding
from souffle_py.cpu_features import host_features
from te_passes.quant import saturate_round


def _blocks(func) -> list[str]:
    return [n for n in re.findall(r'T\.sblock\("(\w+)"\)', func.script()) if n != "root"]


def _gemm_then_scaled():
    """c = a @ w, then a scale s = x[0] * 2 that the DFS order places after the GEMM, then y = c * s."""
    a, w, x = te.placeholder((8, 16), name="a"), te.placeholder((16, 32), name="w"), te.placeholder((1,), name="x")
    k = te.reduce_axis((0, 16), "k")
    c = te.compute((8, 32), lambda i, j: te.sum(a[i, k] * w[k, j], axis=k), name="c")
    s = te.compute((), lambda: x[0] * 2.0, name="s")
    y = te.compute((8, 32), lambda i, j: c[i, j] * s(), name="y")
    return [a, w, x, y]


def test_a_scalar_stage_moves_before_the_gemm_it_does_not_read():
    before = te.create_prim_func(_gemm_then_scaled())
    assert _blocks(before) == ["c", "s", "y"]
    after = scalars_early(before)
    assert _blocks(after) == ["s", "c", "y"]
    assert scalars_early(after).same_as(after)  # nothing left to move


def test_a_scalar_stage_stays_after_what_it_reads():
    a, w = te.placeholder((8, 16), name="a"), te.placeholder((16, 32), name="w")
    k = te.reduce_axis((0, 16), "k")
    c = te.compute((8, 32), lambda i, j: te.sum(a[i, k] * w[k, j], axis=k), name="c")
    s = te.compute((), lambda: c[0, 0] * 2.0, name="s")
    y = te.compute((8, 32), lambda i, j: c[i, j] * s(), name="y")
    func = te.create_prim_func([a, w, y])
    assert scalars_early(func).same_as(func)


def test_kernels_compute_the_same_with_scalars_first():
    tensors = _gemm_then_scaled()
    func = kernel_func(tensors)
    assert _blocks(func) == ["s", "c", "y"]
    lib = tvm.compile(tvm.IRModule({"main": func}), target="llvm", tir_pipeline=PIPELINE)
    rng = np.random.default_rng(0)
    a, w, x = (rng.standard_normal(s).astype(np.float32) for s in ((8, 16), (16, 32), (1,)))
    out = tvm.runtime.tensor(np.zeros((8, 32), np.float32))
    lib["main"](*(tvm.runtime.tensor(v) for v in (a, w, x)), out)
    np.testing.assert_allclose(out.numpy(), a @ w * (x[0] * 2), rtol=1e-5, atol=1e-5)


def _vectorized(func, lanes: int):
    """(the library, its assembly): `func`'s block y vectorized by `lanes`, compiled for sapphirerapids."""
    sch = s_tir.Schedule(func)
    _, inner = sch.split(sch.get_loops(sch.get_sblock("y"))[0], [None, lanes])
    sch.vectorize(inner)
    lib = tvm.compile(sch.mod, target={"kind": "llvm", "mcpu": "sapphirerapids"}, tir_pipeline=PIPELINE)
    return lib, (lib.mod.inspect_source("asm") if hasattr(lib, "mod") else lib.inspect_source("asm"))


def test_nearbyint_is_vectorized_and_rounds_half_to_even():
    x = te.placeholder((64,), name="x")
    y = te.compute((64,), lambda i: tirx.nearbyint(x[i]), name="y")
    func = te.create_prim_func([x, y])
    assert "llvm.nearbyint" not in func.script() and "nearbyint" in func.script()
    assert "call_llvm_pure_intrin" in vector_rounding(func).script()
    lib, asm = _vectorized(func, 16)
    assert "gather" not in asm and "vrndscaleps" in asm
    values = np.array([0.5, 1.5, 2.5, -0.5, -1.5, 3.49, -2.51] + [0.25] * 57, np.float32)
    out = tvm.runtime.tensor(np.zeros(64, np.float32))
    if "avx512f" in (host_features() or set()):  # the host can run what was compiled for sapphirerapids
        lib["main"](tvm.runtime.tensor(values), out)
        np.testing.assert_array_equal(out.numpy(), np.rint(values))


@pytest.mark.parametrize("dtype,zero", [("int8", -128), ("int8", 3), ("uint8", 0), ("uint8", 7)])
def test_a_saturating_quantization_converts_as_it_rounds(dtype, zero):
    """q8(clamp(nearbyint(v) + z)) as q8(lrint(clamp(v, lo - z, hi - z)) + z): vcvtps2dq and no
    vrndscaleps, the same values as numpy's rint and clip, NaN to the lowest value, infinities saturated."""
    x = te.placeholder((64,), name="x")
    y = te.compute((64,), lambda i: saturate_round(x[i] * 1.0, tirx.const(zero, "int32"), dtype), name="y")
    func = te.create_prim_func([x, y])
    assert "llvm.lrint" in vector_rounding(func).script()
    lib, asm = _vectorized(func, 16)
    assert "vcvtps2dq" in asm and "vrndscaleps" not in asm and "gather" not in asm
    values = np.array([np.nan, np.inf, -np.inf, 0.5, 1.5, 2.5, 254.5, 300, -3, 127.49999, -127.5, -128.5,
                       126.5, 3e9, -3e9] + [0.25] * 49, np.float32)
    if "avx512f" in (host_features() or set()):
        out = tvm.runtime.tensor(np.zeros(64, dtype))
        lib["main"](tvm.runtime.tensor(values), out)
        lo, hi = np.iinfo(dtype).min, np.iinfo(dtype).max
        with np.errstate(invalid="ignore"):
            expected = np.where(np.isnan(values), lo, np.clip(np.rint(values) + zero, lo, hi)).astype(dtype)
        np.testing.assert_array_equal(out.numpy(), expected)


def test_a_clamp_that_is_not_a_quantization_keeps_its_rounding():
    x = te.placeholder((64,), name="x")
    y = te.compute((64,), lambda i: tirx.min(tirx.max(tirx.nearbyint(x[i]) + 0.5, -1.0), 1.0).astype("int8"),
                   name="y")
    script = vector_rounding(te.create_prim_func([x, y])).script()
    assert "llvm.lrint" not in script and "llvm.nearbyint" in script


@pytest.mark.parametrize("dtype,zero", [("int8", -128), ("int8", 3), ("uint8", 0)])
def test_a_bounded_quantization_clamps_the_integer(dtype, zero):
    """A value bounded by its 8-bit leaves (float_bounds.py: a residual add's sum) converts unclamped and
    is clamped as an integer (no vmaxps / vminps): every int8 input gives numpy's rint and clip."""
    x = te.placeholder((256,), "int8", name="x")
    y = te.compute((256,), lambda i: saturate_round(
        (x[i].astype("int32") + 128).astype("float32") * 1.37 - 100.0, tirx.const(zero, "int32"), dtype), name="y")
    lib, asm = _vectorized(te.create_prim_func([x, y]), 64)
    assert "vcvtps2dq" in asm and "vmaxps" not in asm and "vminps" not in asm
    values = np.arange(-128, 128).astype(np.int8)
    if "avx512f" in (host_features() or set()):
        out = tvm.runtime.tensor(np.zeros(256, dtype))
        lib["main"](tvm.runtime.tensor(values), out)
        v = (values.astype(np.int32) + 128).astype(np.float32) * np.float32(1.37) - np.float32(100.0)
        info = np.iinfo(dtype)
        np.testing.assert_array_equal(out.numpy(), np.clip(np.rint(v) + zero, info.min, info.max).astype(dtype))
