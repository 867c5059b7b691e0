"""schedule/rules/softmax_gemm.py: attention's softmax over data beyond the caches computed under its context
GEMM's row tiles, values unchanged; smaller attention keeps the row chains' and GEMM's own schedules."""

import numpy as np
import pytest
import tvm
from tvm import te

from souffle_py.schedule.default import schedule_cpu
from souffle_py.schedule.thresholds import ROW_CHAIN_MIN_BYTES
from souffle_py.target import resolve_target
from tests.test_row_chains import _softmax

TARGET = resolve_target("llvm")


def _attention(heads, tokens, dim):
    """softmax(S) . V for given scores S [1, heads, tokens, tokens] and values V [1, heads, tokens, dim]."""
    s, y = _softmax((1, heads, tokens, tokens))
    v = te.placeholder((1, heads, tokens, dim), name="v")
    k = te.reduce_axis((0, tokens), "k")
    out = te.compute((1, heads, tokens, dim), lambda b, h, i, j: te.sum(y[b, h, i, k] * v[b, h, k, j], axis=k),
                     name="context")
    return [s, v, out]


def _expected(s, v):
    e = np.exp(s - s.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)) @ v


def _run(func, *values):
    lib = tvm.compile(func, target=TARGET)
    args = [tvm.runtime.tensor(v) for v in values]
    out = tvm.runtime.tensor(np.zeros((*values[0].shape[:-1], values[1].shape[-1]), np.float32))
    lib["main"](*args, out)
    return out.numpy()


@pytest.mark.parametrize("heads, tokens", [(1, 1500), (2, 1001)])  # Whisper's 1500 keys: 15-row tiles; 13
def test_the_probabilities_of_long_attention_stay_in_the_row_tile(heads, tokens):
    assert heads * tokens * tokens * 4 >= ROW_CHAIN_MIN_BYTES
    func = schedule_cpu(te.create_prim_func(_attention(heads, tokens, 32)))
    assert func.script().count("T.parallel(") == 1  # max, sum, probabilities and context under one loop
    rng = np.random.default_rng(0)
    s = (rng.standard_normal((1, heads, tokens, tokens)) * 3).astype(np.float32)
    v = rng.standard_normal((1, heads, tokens, 32)).astype(np.float32)
    np.testing.assert_allclose(_run(func, s, v), _expected(s, v), rtol=1e-4, atol=1e-5)


def test_attention_within_the_caches_keeps_its_own_schedules():
    """BERT-base's 12 x 128 x 128 probabilities (786 KB) stay in L2 between the stages."""
    script = schedule_cpu(te.create_prim_func(_attention(12, 128, 64))).script()
    assert script.count("T.parallel(") >= 4


def test_values_read_through_a_cast_are_an_operand_like_any_other():
    """P . cast(V): the operand is a Cast of a load (float16 values widened; te_passes/precision.py makes
    the same), which the rule reads through instead of failing on (a MiniLM export did)."""
    s, y = _softmax((1, 2, 1001, 1001))
    v16 = te.placeholder((1, 2, 1001, 32), "float16", name="v16")
    k = te.reduce_axis((0, 1001), "k")
    out = te.compute((1, 2, 1001, 32), lambda b, h, i, j: te.sum(y[b, h, i, k] * v16[b, h, k, j].astype("float32"),
                                                                  axis=k), name="context")
    func = schedule_cpu(te.create_prim_func([s, v16, out]))
    assert func.script().count("T.parallel(") == 1  # the softmax chain under the context GEMM's row tiles
    rng = np.random.default_rng(1)
    scores = (rng.standard_normal((1, 2, 1001, 1001)) * 3).astype(np.float32)
    values = rng.standard_normal((1, 2, 1001, 32)).astype(np.float16)
    np.testing.assert_allclose(_run(func, scores, values), _expected(scores, values.astype(np.float32)),
                               rtol=1e-4, atol=1e-5)


def _masked_attention_model():
    """A transformers-style encoder attention (6 heads x 512 tokens x 16): Q, K, V projections, a padding
    mask built with GreaterOrEqual and And, applied as an additive bias through Cast and by
    Where(mask, scores, -inf); the probabilities (6 MB) are beyond ROW_CHAIN_MIN_BYTES."""
    from onnx import TensorProto, helper, numpy_helper

    from models.common import IR_VERSION

    rng = np.random.default_rng(2)
    heads, tokens, dim = 6, 512, 16
    width = heads * dim
    consts = {f"w{n}": rng.standard_normal((width, width)).astype(np.float32) * 0.1 for n in "qkv"}
    consts.update(one=np.array(1, np.int64), onef=np.float32(1), big=np.float32(-1e4), ninf=np.float32(-np.inf),
                  scale=np.float32(0.25), shape=np.array([1, tokens, heads, dim], np.int64),
                  row=np.array([1, 1, 1, tokens], np.int64), col=np.array([1, 1, tokens, 1], np.int64))
    n = helper.make_node
    nodes = [n("GreaterOrEqual", ["ids", "one"], ["valid"]),
             n("Reshape", ["valid", "row"], ["valid_row"]), n("Reshape", ["valid", "col"], ["valid_col"]),
             n("And", ["valid_row", "valid_col"], ["mask"]),
             n("Cast", ["mask"], ["mask_f"], to=TensorProto.FLOAT), n("Sub", ["onef", "mask_f"], ["inv"]),
             n("Mul", ["inv", "big"], ["bias"])]
    for name in "qkv":
        nodes += [n("MatMul", ["x", f"w{name}"], [f"{name}2"]), n("Reshape", [f"{name}2", "shape"], [f"{name}4"]),
                  n("Transpose", [f"{name}4"], [f"{name}h"], perm=[0, 2, 3, 1] if name == "k" else [0, 2, 1, 3])]
    nodes += [n("MatMul", ["qh", "kh"], ["qk"]), n("Mul", ["qk", "scale"], ["scores"]),
              n("Add", ["scores", "bias"], ["biased"]), n("Where", ["mask", "biased", "ninf"], ["masked"]),
              n("Softmax", ["masked"], ["probs"], axis=-1), n("MatMul", ["probs", "vh"], ["context"])]
    graph = helper.make_graph(
        nodes, "masked_attention", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, tokens, width]),
                                    helper.make_tensor_value_info("ids", TensorProto.INT64, [1, tokens])],
        [helper.make_tensor_value_info("context", TensorProto.FLOAT, [1, heads, tokens, dim])],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in consts.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=IR_VERSION)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_masked_attention_matches_onnx_runtime(precision):
    """Padding rows are fully masked (softmax of -inf only: NaN, as in ONNX Runtime)."""
    import souffle_py
    from souffle_py.baselines import OnnxRuntimeModel
    from souffle_py.errors import TargetError

    model = _masked_attention_model()
    try:
        compiled = souffle_py.optimize(model, quiet=True, precision=precision)
    except TargetError:
        pytest.skip("this CPU has no AVX512_BF16")
    rng = np.random.default_rng(3)
    ids = rng.integers(1, 1000, (1, 512))
    ids[0, 480:] = 0  # padding
    feeds = {"x": rng.standard_normal((1, 512, 96)).astype(np.float32), "ids": ids}
    ours = compiled.run(feeds)["context"]
    expected = OnnxRuntimeModel(model, threads=1).run(feeds)["context"]
    np.testing.assert_array_equal(np.isnan(ours), np.isnan(expected))
    assert np.isnan(expected[0, :, 480:]).all() and not np.isnan(expected[0, :, :480]).any()
    tolerance = 1e-4 if precision == "fp32" else 3e-2  # bfloat16 projections: 8 bits of mantissa
    np.testing.assert_allclose(ours, expected, rtol=tolerance, atol=tolerance)
