"""Mixed precision (te_passes/precision.py, schedule/bf16_gemm.py): the bf16 policy's TE rewrite, the
vdpbf16ps micro-kernel, errors for precisions a target cannot serve, the precision in the plan and the
exported file, fp32 unchanged, and every model's bf16 error bounded.

The error bound. bfloat16 keeps 8 significant bits (7 stored + the implicit one), so rounding an operand
has a relative error of at most u = 2^-8; a product of two rounded operands at most 2u, and a dot product
summed in float32 at most 2u times the sum of |terms|. Layer norms and softmax renormalize between GEMMs,
so errors do not compound with depth; allowing a few GEMMs in a row and terms of mixed sign, we bound
each output's max abs error by TOLERANCE = 8u (3.1%) of the output's largest magnitude. A bug (a wrong
index, a dropped pair) shows up as an error of the order of the values themselves.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm

import souffle_py
from models.registry import MODEL_NAMES, build_model
from souffle_py.backends import backend_for
from souffle_py.backends.cpu import host_target
from souffle_py.baselines import OnnxRuntimeModel
from souffle_py.errors import InputError, TargetError
from souffle_py.frontend import load_model, lower
from souffle_py.ir.marks import BF16_GEMM
from te_passes.precision import bf16_bits, bf16_values, pack_pairs, reduce_precision

UNIT_ROUNDOFF = 2.0 ** -8
TOLERANCE = 8 * UNIT_ROUNDOFF
HAS_BF16 = tvm.target.codegen.target_has_features("avx512bf16", host_target())
needs_bf16 = pytest.mark.skipif(not HAS_BF16, reason="the host CPU lacks AVX512_BF16")


def _asm(model) -> str:
    module = model._module
    return getattr(module, "mod", module).inspect_source("asm")


def test_rounding_matches_ml_dtypes_nearest_even():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    values = np.random.default_rng(0).standard_normal(4096).astype(np.float32) * 100
    values[:4] = [1 + 2 ** -8, 1 + 3 * 2 ** -8, -0.0, 1e-30]  # ties to even both ways, a signed zero, a denormal
    expected = values.astype(ml_dtypes.bfloat16).view(np.uint16)
    np.testing.assert_array_equal(bf16_bits(values), expected)
    assert np.all(np.abs(bf16_values(bf16_bits(values)) - values) <= UNIT_ROUNDOFF * np.abs(values))


def test_weights_are_packed_in_k_pairs_of_sixteen_columns():
    weight = np.arange(8 * 32, dtype=np.float32).reshape(8, 32)  # small integers: exact in bfloat16
    packed = pack_pairs(weight, 16)
    assert packed.shape == (2, 4, 16, 2) and packed.dtype == np.uint16
    for jb, kp, lane, p in [(0, 0, 0, 0), (1, 3, 15, 1), (0, 2, 7, 1)]:
        assert bf16_values(packed[jb, kp, lane, p]) == weight[2 * kp + p, 16 * jb + lane]


def test_fp32_leaves_the_program_alone_and_bf16_converts_the_gemms():
    program = lower(load_model(build_model("bert", tiny=True)))
    assert reduce_precision(program, "fp32") is program
    converted = reduce_precision(program, "bf16")
    gemms = [op for op in converted.stages if BF16_GEMM in (op.attrs or {})]
    assert gemms, "no GEMM converted"
    assert all(str(t.dtype) == "uint16" for op in gemms for t in op.input_tensors)
    assert any(str(v.dtype) == "uint16" for v in converted.params.values())
    assert all(str(v.dtype) == "float32" for v in program.params.values())  # the input program is untouched


@needs_bf16
def test_bf16_gemms_run_on_vdpbf16ps():
    model = souffle_py.optimize(build_model("bert", tiny=True), precision="bf16", quiet=True)
    assert "vdpbf16ps" in _asm(model)
    assert "vdpbf16ps" not in _asm(souffle_py.optimize(build_model("bert", tiny=True), quiet=True))


@needs_bf16
def test_a_prime_token_count_takes_padded_row_tiles_on_vdpbf16ps():
    """13 tokens: the rows are zero-padded to two tiles of 7 (one-row tiles before), still on vdpbf16ps."""
    proto = build_model("bert", tiny=True, seq=13)
    model = souffle_py.optimize(proto, precision="bf16", quiet=True, cache=False)
    feeds = model.random_feeds(0)
    ours, reference = model.run(feeds), OnnxRuntimeModel(proto, threads=1).run(feeds)
    for output, expected in reference.items():
        assert np.abs(ours[output].astype(np.float64) - expected).max() <= TOLERANCE * np.abs(expected).max()
    assert "vdpbf16ps" in _asm(model)
    text = "\n".join(f.script() for f in model.scheduled_functions.values())
    assert '_pad = T.sblock_alloc_buffer((1, 14, 64), "uint16")' in text


@needs_bf16
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_every_tiny_model_within_the_bf16_bound(name):
    proto = build_model(name, tiny=True)
    model = souffle_py.optimize(proto, precision="bf16", quiet=True)
    feeds = model.random_feeds(0)
    if name == "sbert":
        from models import sbert
        feeds = sbert.example_feeds(sbert.TINY)
    ours, reference = model.run(feeds), OnnxRuntimeModel(proto, threads=1).run(feeds)
    for output, expected in reference.items():
        error = np.abs(ours[output].astype(np.float64) - expected).max()
        assert error <= TOLERANCE * np.abs(expected).max(), f"{output}: max abs error {error:.3g}"


@pytest.mark.parametrize("name", ["bert", "lstm", "resnext", "efficientnet"])
def test_fp32_results_unchanged(name):
    """fp32 results and scheduled kernels are the same with and without the precision argument."""
    proto = build_model(name, tiny=True)
    default = souffle_py.optimize(proto, quiet=True)
    explicit = souffle_py.optimize(proto, precision="fp32", quiet=True)
    feeds = default.random_feeds(0)
    for output, value in default.run(feeds).items():
        np.testing.assert_array_equal(explicit.run(feeds)[output], value)
    assert {n: f.script() for n, f in default.scheduled_functions.items()} == \
        {n: f.script() for n, f in explicit.scheduled_functions.items()}
    assert default.plan.precision == "fp32" and "precision fp32" in default.describe()


def test_unservable_precisions_raise_target_errors():
    proto = build_model("bert", tiny=True)
    old_cpu = tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512"})
    with pytest.raises(TargetError, match="AVX512_BF16"):
        souffle_py.optimize(proto, target=old_cpu, precision="bf16")
    with pytest.raises(TargetError, match="AVX512_FP16"):
        souffle_py.optimize(proto, precision="fp16")
    volta = tvm.target.Target({"kind": "cuda", "arch": "sm_70"})
    with pytest.raises(TargetError, match="sm_70"):  # bfloat16 tensor cores from sm_80 (test_cuda_precision.py)
        backend_for(volta).check_precision("bf16")
    with pytest.raises(InputError, match="precision"):
        souffle_py.optimize(proto, precision="int8")


@needs_bf16
def test_precision_is_recorded_in_the_plan_and_the_exported_file(tmp_path):
    proto = build_model("bert", tiny=True)
    model = souffle_py.optimize(proto, precision="bf16", quiet=True)
    assert model.plan.precision == "bf16" and "precision bf16" in model.describe()
    path = tmp_path / "bert.tar"
    model.export(path)
    loaded = souffle_py.load(path)
    assert loaded.plan.precision == "bf16" and "precision bf16" in loaded.describe()
    feeds = model.random_feeds(1)
    for output, value in model.run(feeds).items():
        np.testing.assert_array_equal(loaded.run(feeds)[output], value)


@needs_bf16
def test_the_bf16_peak_kernel_runs_vdpbf16ps():
    from souffle_py.backends.cpu_peak import bf16_peak_kernel, measured_bf16_peak_gflops

    built = tvm.compile(tvm.IRModule({"main": bf16_peak_kernel(2, 8)}), target=host_target())
    assert built.mod.inspect_source("asm").count("vdpbf16ps") >= 8
    assert measured_bf16_peak_gflops(host_target(), 1) > 0
    assert backend_for("llvm").peak_gflops(precision="bf16") > 0


@needs_bf16
@pytest.mark.parametrize("one_thread", [False, True])
def test_the_default_schedule_tensorizes_a_bf16_gemm(one_thread):
    """Both the parallel schedule and the one-thread one (a model of little work) run vdpbf16ps and
    compute the GEMM of the rounded operands (float32 accumulation: only the summation order differs)."""
    from tvm import te

    from souffle_py.schedule.default import schedule_cpu
    from te_passes.precision import widen

    rows, cols, depth = 2 * 64, 64, 96  # rows as two sequences of 64: the fused row axis
    a = te.placeholder((2, 64, depth), "uint16", name="a")
    w = te.placeholder((cols // 16, depth // 2, 16, 2), "uint16", name="w")
    k = te.reduce_axis((0, depth), name="k")
    c = te.compute((2, 64, cols), lambda b, i, j: te.sum(
        widen(a[b, i, k]) * widen(w[j // 16, k // 2, j % 16, k % 2]), axis=k), name="c", attrs={BF16_GEMM: 16})
    func = schedule_cpu(te.create_prim_func([a, w, c]), one_thread=one_thread)
    built = tvm.compile(tvm.IRModule({"main": func}), target=host_target())
    assert "vdpbf16ps" in built.mod.inspect_source("asm")
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((2, 64, depth)).astype(np.float32), rng.standard_normal((depth, cols)).astype(np.float32)
    out = tvm.runtime.empty((2, 64, cols), "float32", tvm.cpu())
    built["main"](tvm.runtime.tensor(bf16_bits(x)), tvm.runtime.tensor(pack_pairs(y)), out)
    expected = bf16_values(bf16_bits(x)).reshape(rows, depth) @ bf16_values(bf16_bits(y))
    np.testing.assert_allclose(out.numpy().reshape(rows, cols), expected, rtol=1e-5, atol=1e-4)
