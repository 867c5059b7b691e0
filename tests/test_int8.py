"""int8: the quantization operators (frontend/ops/quantize.py) and int8 models made by
onnxruntime.quantization, against ONNX Runtime running the same file.

What is exact and what is within one quantization step, and why:
- QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear alone: bit for bit (the same float32 division,
  round half to even, saturation; the same float32 multiply).
- QOperator models (QLinearConv, QLinearMatMul, QLinearAdd): the int8 values bit for bit. Products are
  summed in int32 in both and requantized with the same float32 multiplier a_s * b_s / y_s, rounded half
  to even after the same clamp (ONNX Runtime's MlasRequantizeOutput). QLinearAdd is computed in float32
  in both, ONNX Runtime with a precomputed reciprocal scale, so its values may differ by one step.
- QDQ models: ONNX Runtime fuses DequantizeLinear -> Conv/MatMul (-> bias) -> QuantizeLinear into its
  integer kernels, and so does souffle-py (te_passes/integer_kernels.py): int8 products summed in int32, the
  int32 bias added, one requantization with ONNX Runtime's multiplier, so those values are bit for bit
  (the MLPs come out bit for bit). What stays float32 in souffle-py may land a value in the neighbouring
  step: the residual Add (dequantized, added and quantized in float32, where ONNX Runtime runs a
  QLinearAdd with precomputed scale ratios) and convolutions of uint8 weights (zero points not 0: a
  float32 convolution of the dequantized values), so QDQ conv nets are asserted within one step (1-2 of
  4096 values differ in some variants).
- Dynamically quantized BERT (quantize_dynamic): activations are quantized per tensor at run time from
  their float range; the float32 parts (layer norms, GELU, softmax, the scales applied to the int32
  products: ONNX Runtime fuses them into DynamicQuantizeMatMul, scaling by a_s * b_s at once) differ in
  their last bits, so the outputs agree to float32 rounding (measured 6e-7 of 3.2) as long as no
  activation lands in the neighbouring step; one that did would cost about 1e-2 (a step of ~0.02 times a
  weight), and the bound, 1e-4 of the output's magnitude, would catch it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import onnx.version_converter
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

import souffle_py
from models.registry import build_model
from souffle_py.cpu_features import host_features
from souffle_py.cpu_target import CpuTarget
from souffle_py.errors import UnsupportedError
from souffle_py.frontend import load_model, lower
from souffle_py.passes import conv_weights_blocked
from souffle_py.schedule.int8_dot import dot4
from te_passes.int8_conv import INT8_CONV
from te_passes.int8_gemm import INT8_GEMM
from te_passes.integer_kernels import integer_kernels
from te_passes.quant import QUANTIZE_TAG

sys.path.insert(0, str(Path(__file__).parent))
from int8_models import conv_net, mlp, quantized, random_feeds  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")


# ONNX Runtime's int8 kernels on an x86 host without VNNI (MLAS's AVX2 and AVX-512BW kernels) sum each
# pair of uint8 x int8 products with vpmaddubsw into int16, which saturates above 32767: its QDQ fusions,
# MatMulInteger, ConvInteger, QLinearConv and QLinearMatMul of uint8 activations then err by up to 16
# output steps (measured on AMD Zen 3; ONNX Runtime's docs name the saturation and suggest reduce_range).
# There the exact reference is the file's operators one by one: ONNX Runtime with its graph optimizations
# off (DequantizeLinear, a float32 Conv / MatMul, QuantizeLinear), or, where the file holds integer
# kernels, ONNX's reference evaluator (integer sums in numpy).
ORT_SATURATES = {"avx2"} <= (host_features() or set()) and not {"avx512vnni", "avxvnni"} & (host_features() or set())
INTEGER_KERNELS = {"MatMulInteger", "ConvInteger", "QLinearConv", "QLinearMatMul", "QLinearAdd"}


def _ort(path_or_model, feeds):
    """The reference outputs of `path_or_model`: ONNX Runtime's, where its int8 kernels are exact (above)."""
    model = path_or_model if isinstance(path_or_model, onnx.ModelProto) else onnx.load(path_or_model)
    options = ort.SessionOptions()
    if ORT_SATURATES:
        if any(node.op_type in INTEGER_KERNELS for node in model.graph.node):
            # the evaluator implements QuantizeLinear / DequantizeLinear from opset 19 (the same values)
            model = onnx.version_converter.convert_version(model, max(19, _opset(model)))
            return ReferenceEvaluator(model, new_ops=[QLinearAdd]).run(None, feeds)
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, feeds)


def _opset(model) -> int:
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


class QLinearAdd(OpRun):
    """ONNX Runtime's contrib QLinearAdd (com.microsoft), for the reference evaluator: both operands
    dequantized, added in float32 and quantized (ONNX Runtime multiplies by precomputed scale ratios, so
    its values may differ from these by one step)."""

    op_domain = "com.microsoft"

    def _run(self, a, a_scale, a_zero, b, b_scale, b_zero, y_scale, y_zero):
        total = ((a.astype(np.int32) - a_zero.astype(np.int32)).astype(np.float32) * a_scale
                 + (b.astype(np.int32) - b_zero.astype(np.int32)).astype(np.float32) * b_scale)
        info = np.iinfo(y_zero.dtype)
        return (np.clip(np.rint(total / y_scale) + y_zero.astype(np.float32), info.min, info.max).astype(y_zero.dtype),)


def _souffle(path_or_model, feeds):
    model = souffle_py.optimize(path_or_model, quiet=True)
    out = model.run(feeds)
    return list(out.values()) if isinstance(out, dict) else list(out) if isinstance(out, (list, tuple)) else [out]


def _output_step(path: str) -> float:
    """The quantization step of the model's output: the scale of the DequantizeLinear that produces it."""
    model = onnx.load(path)
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    node = next(n for n in model.graph.node if n.output[0] == model.graph.output[0].name)
    assert node.op_type == "DequantizeLinear"
    return float(inits[node.input[1]].reshape(-1)[0])


def _single_node(node, inputs, outputs, inits=(), opset=21):
    graph = helper.make_graph([node], "one", inputs, outputs, list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


# --- the operators alone ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["int8", "uint8"])
@pytest.mark.parametrize("per_axis", [False, True])
def test_quantize_dequantize_match_onnxruntime_bit_for_bit(dtype, per_axis):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((2, 4, 5, 6)) * 3).astype(np.float32)
    x[0, 0, 0, :6] = [0.5, 1.5, 2.5, -0.5, -2.5, 1000.0]  # ties to even both ways, saturation
    x[0, :, 1, :3] = [np.nan, np.inf, -np.inf]  # NaN saturates to the lowest value, as in ONNX Runtime
    code = TensorProto.INT8 if dtype == "int8" else TensorProto.UINT8
    scale = np.float32([1.0, 0.25, 0.5, 0.125]) if per_axis else np.float32(1.0)
    zero = (np.array([0, 3, -2, 1] if dtype == "int8" else [0, 128, 7, 250]) if per_axis
            else np.array(0 if dtype == "int8" else 128)).astype(dtype)
    inits = [numpy_helper.from_array(scale, "s"), numpy_helper.from_array(zero, "z")]
    quant = _single_node(helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], axis=1),
                         [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
                         [helper.make_tensor_value_info("q", code, x.shape)], inits)
    q_ref = _ort(quant, {"x": x})[0]
    q = _souffle(quant, {"x": x})[0]
    assert q.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(q, q_ref)
    dequant = _single_node(helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], axis=1),
                           [helper.make_tensor_value_info("q", code, x.shape)],
                           [helper.make_tensor_value_info("y", TensorProto.FLOAT, x.shape)], inits)
    np.testing.assert_array_equal(_souffle(dequant, {"q": q_ref})[0], _ort(dequant, {"q": q_ref})[0])


def test_dynamic_quantize_linear_matches_onnxruntime_bit_for_bit():
    x = np.random.default_rng(4).standard_normal((3, 40)).astype(np.float32) * 2 + 0.5
    model = _single_node(helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "s", "z"]),
                         [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
                         [helper.make_tensor_value_info("y", TensorProto.UINT8, x.shape),
                          helper.make_tensor_value_info("s", TensorProto.FLOAT, []),
                          helper.make_tensor_value_info("z", TensorProto.UINT8, [])])
    for got, want in zip(_souffle(model, {"x": x}), _ort(model, {"x": x})):
        np.testing.assert_array_equal(np.asarray(got).reshape(np.shape(want)), want)


def test_matmul_integer_and_conv_integer_match_onnxruntime_exactly():
    rng = np.random.default_rng(5)
    a = rng.integers(0, 256, (4, 32)).astype(np.uint8)
    w = rng.integers(-128, 128, (32, 16)).astype(np.int8)
    zb = rng.integers(-3, 4, (16,)).astype(np.int8)  # per-column weight zero points
    mm = _single_node(helper.make_node("MatMulInteger", ["a", "w", "za", "zb"], ["y"]),
                      [helper.make_tensor_value_info("a", TensorProto.UINT8, a.shape)],
                      [helper.make_tensor_value_info("y", TensorProto.INT32, (4, 16))],
                      [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.uint8(131), "za"),
                       numpy_helper.from_array(zb, "zb")])
    np.testing.assert_array_equal(_souffle(mm, {"a": a})[0], _ort(mm, {"a": a})[0])
    x = rng.integers(0, 256, (1, 8, 6, 6)).astype(np.uint8)
    wc = rng.integers(-128, 128, (16, 8, 3, 3)).astype(np.int8)
    conv = _single_node(helper.make_node("ConvInteger", ["x", "w", "zx"], ["y"], pads=[1, 1, 1, 1]),
                        [helper.make_tensor_value_info("x", TensorProto.UINT8, x.shape)],
                        [helper.make_tensor_value_info("y", TensorProto.INT32, (1, 16, 6, 6))],
                        [numpy_helper.from_array(wc, "w"), numpy_helper.from_array(np.uint8(100), "zx")])
    np.testing.assert_array_equal(_souffle(conv, {"x": x})[0], _ort(conv, {"x": x})[0])


def test_block_quantization_is_refused_by_node_name():
    x = np.zeros((4, 8), np.float32)
    model = _single_node(helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], name="blocky", axis=1,
                                          block_size=4),
                         [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
                         [helper.make_tensor_value_info("q", TensorProto.INT8, x.shape)],
                         [numpy_helper.from_array(np.ones((4, 2), np.float32), "s"),
                          numpy_helper.from_array(np.zeros((4, 2), np.int8), "z")])
    with pytest.raises(UnsupportedError, match="blocky.*block"):
        souffle_py.optimize(model, quiet=True)


# --- models made by onnxruntime.quantization ----------------------------------------------------------

# (format, activations, weights, per-channel weights): s8s8 and u8s8 both ways, and u8u8 (weight zero points
# not 0: the integer GEMM's row sums) per channel
STATIC_CASES = [(fmt, act, "int8", pc) for fmt in ("QDQ", "QOperator") for act in ("int8", "uint8")
                for pc in (False, True)] + [("QDQ", "uint8", "uint8", True), ("QOperator", "uint8", "uint8", True)]


@pytest.mark.parametrize("builder", [conv_net, mlp], ids=["conv_net", "mlp"])
@pytest.mark.parametrize("fmt,activations,weights,per_channel", STATIC_CASES)
def test_static_quantized_models_match_onnxruntime(tmp_path, builder, fmt, activations, weights, per_channel):
    fp32 = builder()
    path = quantized(fp32, str(tmp_path), fmt=fmt, activations=activations, weights=weights,
                     per_channel=per_channel)
    step = _output_step(path)
    for seed in (0, 1):
        feeds = random_feeds(fp32, seed)
        want = _ort(path, feeds)[0]
        got = _souffle(path, feeds)[0]
        steps = np.abs(got.astype(np.float64) - want) / step
        # QOperator models and QDQ MLPs bit for bit; QDQ conv nets within one step (module docstring)
        if fmt == "QOperator" or builder is mlp:
            np.testing.assert_array_equal(got, want)
        assert steps.max() <= 1 + 1e-4, f"{steps.max():.2f} steps off"
        assert np.mean(steps > 0.5) < 0.01  # one-step differences are rare ties, not a systematic offset


@pytest.mark.parametrize("builder,kind,count", [(mlp, INT8_GEMM, 3), (conv_net, INT8_CONV, 3)], ids=["mlp", "conv_net"])
@pytest.mark.parametrize("weights", ["int8", "uint8"])
def test_qdq_gemms_and_convs_become_integer_kernels(tmp_path, builder, kind, count, weights):
    """Every GEMM / conv of a QDQ model reads int8 operands and sums in int32 after the pass; convs with
    weight zero points other than 0 (uint8 weights) stay float32 (no window sums yet)."""
    path = quantized(builder(), str(tmp_path), activations="uint8", weights=weights, per_channel=True)
    program = conv_weights_blocked(lower(load_model(path)))  # the conv weights as integer_kernels reads them
    converted = integer_kernels(program)
    ints = [op for op in converted.stages if kind in (op.attrs or {})]
    expected = 0 if (builder is conv_net and weights == "uint8") else count
    assert len(ints) == expected
    for op in ints:
        assert str(op.output(0).dtype) == "int32"
        assert {str(t.dtype) for t in op.input_tensors} <= {"int8", "uint8"}
    row_sums = any("row_sums" in op.name for op in converted.stages)
    assert row_sums == (builder is mlp and weights == "uint8")
    qoperator = conv_weights_blocked(lower(load_model(quantized(builder(), str(tmp_path), fmt="QOperator"))))
    assert integer_kernels(qoperator) is qoperator  # integer already: nothing to do (without VNNI)
    # the QuantizeLinear after each integer kernel requantizes its int32 sum (bias included) directly
    fused = [op for op in converted.stages if QUANTIZE_TAG in (op.attrs or {})
             and any(kind in (t.op.attrs or {}) for t in op.input_tensors)]
    assert len(fused) == expected


def test_dynamic_quantized_bert_matches_onnxruntime(tmp_path):
    fp32 = build_model("bert", tiny=True)
    path = quantized(fp32, str(tmp_path), mode="dynamic")
    feeds = random_feeds(fp32, 0)
    want = _ort(path, feeds)[0]
    compiled = souffle_py.optimize(path, quiet=True, cache=False)
    got = list(compiled.run(feeds).values())[0]
    if HOST_DOT is not None:  # MatMulInteger of a run-time zero point, in vpdpbusd's form
        assert DOT_MNEMONIC in _asm(compiled)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    # and it is a quantized model: its error against float32 is that of int8 (about 2% here), not rounding
    assert np.abs(got - _ort(fp32, feeds)[0]).max() > 100 * np.abs(got - want).max()


def test_dynamic_quantized_conv_net_matches_onnxruntime(tmp_path):
    """quantize_dynamic makes DynamicQuantizeLinear -> ConvInteger of a conv (a ViT's patch embedding, a
    Whisper stem): the input zero point is fed at run time, and the padding is that zero point."""
    fp32 = conv_net()
    path = quantized(fp32, str(tmp_path), mode="dynamic")
    assert any(node.op_type == "ConvInteger" and not any(init.name == node.input[2] for init in
                                                         onnx.load(path).graph.initializer)
               for node in onnx.load(path).graph.node)
    feeds = random_feeds(fp32, 0)
    want = _ort(path, feeds)[0]
    got = list(souffle_py.optimize(path, quiet=True, cache=False).run(feeds).values())[0]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


# --- the VNNI micro-kernel ----------------------------------------------------------------------------

HOST = host_features() or set()
# the host's four-deep dot product (schedule/int8_dot.py): vpdpbusd with VNNI, vpmaddwd pairs on AVX2
HOST_DOT = dot4(CpuTarget.host_cpu())
needs_dot = pytest.mark.skipif(HOST_DOT is None, reason="the host CPU has no int8 dot product (AVX2 or VNNI)")
DOT_MNEMONIC = "vpdpbusd" if HOST_DOT is not None and HOST_DOT.instruction.startswith("vpdpbusd") else "vpmaddwd"
DOT_LANES = HOST_DOT.lanes if HOST_DOT is not None else 0


def _asm(model) -> str:
    module = model._module
    return getattr(module, "mod", module).inspect_source("asm")


@needs_dot
@pytest.mark.parametrize("fmt,activations,weights", [("QDQ", "int8", "int8"), ("QDQ", "uint8", "int8"),
                                                     ("QDQ", "uint8", "uint8"), ("QOperator", "int8", "int8"),
                                                     ("QOperator", "uint8", "int8")])
def test_int8_gemms_run_on_the_dot_product_and_stay_bit_for_bit(tmp_path, fmt, activations, weights):
    """s8 activations shifted into u8 and u8 weights into s8 (te_passes/int8_gemm.py) keep the values; the
    QOperator form's QLinearMatMul (the frontend's integer GEMM) is put in the same form."""
    fp32 = mlp()
    path = quantized(fp32, str(tmp_path), fmt=fmt, activations=activations, weights=weights, per_channel=True)
    compiled = souffle_py.optimize(path, quiet=True, cache=False)
    assert DOT_MNEMONIC in _asm(compiled)
    feeds = random_feeds(fp32, 3)
    np.testing.assert_array_equal(list(compiled.run(feeds).values())[0], _ort(path, feeds)[0])


def _assert_on_the_dot_product_within_one_step(fp32, path) -> None:
    """Compiled, `path` runs the host's dot product and its outputs are within one output step of ONNX
    Runtime's."""
    compiled = souffle_py.optimize(path, quiet=True, cache=False)
    assert DOT_MNEMONIC in _asm(compiled)
    assert_within_one_step(compiled, fp32, path)


def assert_within_one_step(compiled, fp32, path, seeds=(0, 1)) -> None:
    """The compiled model's first output within one output step of ONNX Runtime's on `path`, for the
    random inputs of `seeds`."""
    step = _output_step(path)
    for seed in seeds:
        feeds = random_feeds(fp32, seed)
        steps = np.abs(list(compiled.run(feeds).values())[0].astype(np.float64) - _ort(path, feeds)[0]) / step
        assert steps.max() <= 1 + 1e-4  # float32 outputs of ~100 steps: one step's difference rounds to 1 +- 1e-5


@needs_dot
@pytest.mark.parametrize("activations", ["int8", "uint8"])
def test_qdq_convs_run_on_vpdpbusd_and_match_onnxruntime(tmp_path, activations):
    """The conv net's 8 -> 16 and 16 -> 16 convs in vpdpbusd's form (int8_conv_vnni.py: input channel quads,
    int8 inputs shifted into uint8) on the VNNI conv tiles; the RGB stem (3 -> 8 channels) too where its 8
    filters fill the lanes.
    The values stay those of the plain integer convolution (within one step of ONNX Runtime's, as above)."""
    fp32 = conv_net()
    path = quantized(fp32, str(tmp_path), activations=activations, per_channel=True)
    converted = integer_kernels(conv_weights_blocked(lower(load_model(path))), vnni_lanes=DOT_LANES)
    lanes = sorted(int(op.attrs[INT8_CONV]) for op in converted.stages if INT8_CONV in (op.attrs or {}))
    # the stem's 8 filters fill 8 lanes (AVX2), not 16 (AVX-512: the plain int32 form)
    assert lanes == sorted([1 if 8 % DOT_LANES else DOT_LANES, DOT_LANES, DOT_LANES])
    _assert_on_the_dot_product_within_one_step(fp32, path)


@needs_dot
def test_an_rgb_stem_runs_on_vpdpbusd_with_a_fourth_channel_of_zero_weights(tmp_path):
    """3 input channels are not a quad: the copy adds a fourth whose weights are 0 (int8_conv_vnni.py)."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array((rng.standard_normal((16, 3, 3, 3)) * 0.3).astype(np.float32), "W")
    graph = helper.make_graph([helper.make_node("Conv", ["x", "W"], ["y"], pads=[1, 1, 1, 1], strides=[2, 2])],
                              "stem", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 8, 8])], [w])
    fp32 = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path = quantized(fp32, str(tmp_path), per_channel=True)
    converted = integer_kernels(conv_weights_blocked(lower(load_model(path))), vnni_lanes=DOT_LANES)
    assert [int(op.attrs[INT8_CONV]) for op in converted.stages if INT8_CONV in (op.attrs or {})] == [DOT_LANES]
    _assert_on_the_dot_product_within_one_step(fp32, path)


def test_the_dot_product_is_taken_from_the_target_not_the_host(tmp_path):
    """AVX512_VNNI: vpdpbusd on 16 lanes; AVX-VNNI: on 8; AVX2 and AVX-512 without VNNI: vpmaddwd pairs on
    8 and 16; no AVX2 (x86-64 baseline, AArch64): none, the plain int32 GEMM."""
    from souffle_py.cpu_target import using
    from souffle_py.schedule.int8_dot import dot4_lanes
    expected = {"llvm -mcpu=znver4": (16, "souffle_vpdpbusd"), "llvm -mcpu=alderlake": (8, "souffle_vpdpbusd_256"),
                "llvm -mcpu=haswell": (8, "souffle_dot4_pmaddwd_256"),
                "llvm -mcpu=skylake-avx512": (16, "souffle_dot4_pmaddwd_512"),
                "llvm -mcpu=x86-64": (0, None), "graviton3": (0, None)}
    for target, (lanes, function) in expected.items():
        with using(target):
            assert dot4_lanes() == lanes, target
            assert (dot4().function if dot4() else None) == function, target
    program = lower(load_model(quantized(mlp(), str(tmp_path), per_channel=True)))
    plain = [op.attrs[INT8_GEMM] for op in integer_kernels(program, 0).stages if INT8_GEMM in (op.attrs or {})]
    packed = [op for op in integer_kernels(program, 16).stages if INT8_GEMM in (op.attrs or {})]
    assert plain == [0, 0, 0] and [int(op.attrs[INT8_GEMM]) for op in packed] == [16, 16, 16]
    assert all(t.ndim == 4 and str(t.dtype) == "int8" for op in packed for t in op.input_tensors
               if t.op.name.endswith("_weight_vnni"))


@pytest.mark.skipif(not {"avx2", "fma"} <= HOST, reason="runs AVX2 code")
@pytest.mark.parametrize("builder", [mlp, conv_net], ids=["mlp", "conv_net"])
def test_an_avx2_build_sums_exactly_on_vpmaddwd_pairs(tmp_path, builder):
    """AVX2 has no vpdpbusd: two vpmaddwd on the even and odd bytes widened to 16 bits (schedule/int8_dot.py)
    sum the products exactly, where vpmaddubsw's int16 sums saturate: the values of ONNX's operators one by
    one (on a host without VNNI, where ONNX Runtime's fused kernels saturate: `_ort`)."""
    fp32 = builder()
    path = quantized(fp32, str(tmp_path), activations="uint8", per_channel=True)
    compiled = souffle_py.optimize(path, target="llvm -mcpu=haswell", quiet=True, cache=False)
    asm = _asm(compiled)
    assert "vpmaddwd" in asm and "vpdpbusd" not in asm and "zmm" not in asm
    for seed in (0, 4):
        feeds = random_feeds(fp32, seed)
        np.testing.assert_array_equal(list(compiled.run(feeds).values())[0], _ort(path, feeds)[0])


@pytest.mark.parametrize("target,registers", [("llvm -mcpu=alderlake", "ymm"), ("llvm -mcpu=skylake-avx512", "zmm")])
def test_avx_vnni_and_avx512bw_builds_compile_their_dot_products(tmp_path, target, registers):
    """AVX-VNNI (Alder Lake: no AVX-512) runs vpdpbusd on ymm registers, VEX-encoded; AVX-512 without VNNI
    (Skylake-SP) vpmaddwd pairs on zmm. Compiled here whatever the host; run where the host has the ISA."""
    fp32 = conv_net()
    path = quantized(fp32, str(tmp_path), per_channel=True)
    compiled = souffle_py.optimize(path, target=target, quiet=True, cache=False)
    asm = _asm(compiled)
    mnemonic = "vpdpbusd" if "alderlake" in target else "vpmaddwd"
    assert any(mnemonic in line and f"%{registers}" in line for line in asm.splitlines())
    if not set(compiled.plan.cpu_features) - HOST:  # AVX-VNNI: Emerald Rapids, Zen 5 (not Zen 4)
        assert_within_one_step(compiled, fp32, path)


def test_static_qdq_bert_compiles_and_stays_within_its_quantization_error(tmp_path):
    """A QDQ transformer: quantized softmax, GELU and layer norms between the integer GEMMs. Their float32
    parts run souffle-py's vectorized exp / erf approximations (codegen/fast_math.py) where ONNX Runtime
    calls libm, so values near a half step land in the neighbouring step and the steps propagate through
    the layers: measured 0.11 of 3.2 against ONNX Runtime (four steps of the output's 0.027), where int8
    itself errs by 0.42 against float32. Asserted: within half of int8's own error, and no worse than ONNX
    Runtime's int8 against float32 by more than a quarter (a wrong zero point or scale errs by the order of
    the outputs)."""
    fp32 = build_model("bert", tiny=True)
    path = quantized(fp32, str(tmp_path), per_channel=True)
    feeds = random_feeds(fp32, 0)
    want, reference = _ort(path, feeds)[0], _ort(fp32, feeds)[0]
    got = _souffle(path, feeds)[0]
    int8_error = np.abs(want - reference).max()
    assert np.abs(got - want).max() <= 0.5 * int8_error
    assert np.abs(got - reference).max() <= 1.25 * int8_error


def test_a_zero_bias_at_any_scale_keeps_the_requantization_fused(tmp_path):
    """A bias of zeros dequantized at a scale other than sa * sw[j] (timm's RexNet export: every conv's) is
    zero at any scale: the QuantizeLinear still requantizes the int32 sum directly (ONNX Runtime's QLinearConv
    result), not through a float32 path that flips values lying at half steps."""
    fp32 = conv_net()
    for init in fp32.graph.initializer:
        if init.name in ("B1", "B2"):
            init.CopyFrom(numpy_helper.from_array(np.zeros(numpy_helper.to_array(init).shape, np.float32), init.name))
    model = onnx.load(quantized(fp32, str(tmp_path), activations="uint8", per_channel=True))
    for init in model.graph.initializer:
        if init.name in ("B1_quantized_scale", "B2_quantized_scale"):
            scale = numpy_helper.to_array(init)
            init.CopyFrom(numpy_helper.from_array((scale * 1.7 + 1e-5).astype(np.float32), init.name))
    path = str(tmp_path / "unrelated_bias_scales.onnx")
    onnx.save(model, path)
    converted = integer_kernels(conv_weights_blocked(lower(load_model(path))))
    fused = [op for op in converted.stages if QUANTIZE_TAG in (op.attrs or {})
             and any(INT8_CONV in (t.op.attrs or {}) for t in op.input_tensors)]
    assert len(fused) == 3
    feeds = random_feeds(fp32, 0)
    np.testing.assert_array_equal(_souffle(path, feeds)[0], _ort(path, feeds)[0])


@needs_dot
def test_a_prime_token_count_takes_padded_row_tiles_on_vpdpbusd(tmp_path):
    """13 tokens: the rows' largest divisor gave one-row tiles (a vpdpbusd per weight vector loaded); the
    rows are zero-padded to balanced tiles instead (two of 7 with AVX-512's registers; tensorize refuses a
    masked tile), still on the dot product and as exact as before."""
    fp32 = build_model("bert", tiny=True, seq=13)
    path = quantized(fp32, str(tmp_path), mode="dynamic")
    feeds = random_feeds(fp32, 0)
    want = _ort(path, feeds)[0]
    compiled = souffle_py.optimize(path, quiet=True, cache=False)
    got = list(compiled.run(feeds).values())[0]
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    assert DOT_MNEMONIC in _asm(compiled)
    text = "\n".join(f.script() for f in compiled.scheduled_functions.values())
    from souffle_py.schedule.budgets import gemm_tile_rows
    from souffle_py.schedule.ragged import tile_rows
    tile = tile_rows(13, gemm_tile_rows())[0]  # 7 of 8 rows (32 registers), 4 of 4 (AVX2's 16)
    quads = "int16" if HOST_DOT.split_weights else "uint8"  # split: the activations widened in memory
    assert f'_pad = T.sblock_alloc_buffer((1, {-(-13 // tile) * tile}, 64), "{quads}")' in text
