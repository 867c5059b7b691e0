"""bf16 convolutions on the CPU (te_passes/precision_conv.py, schedule/bf16_conv.py): which convolutions
take bfloat16 operands and which stay float32 (and say why), the packed weights, vdpbf16ps in the
assembly, outputs within the bf16 bound of test_precision.py against ONNX Runtime, fp32 unchanged."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from onnx import numpy_helper

import souffle_py
from models.common import GraphBuilder, conv_bn
from models.registry import build_model
from souffle_py.passes import prepared
from souffle_py.backends import backend_for
from souffle_py.baselines import OnnxRuntimeModel
from souffle_py.frontend import load_model, lower
from te_passes.precision import bf16_bits
from te_passes.precision_conv import BF16_CONV, reduce_conv_precision
from tests.test_precision import HAS_BF16, TOLERANCE, _asm
from test_cpu_target import SPR

needs_bf16 = pytest.mark.skipif(not HAS_BF16, reason="the host CPU lacks AVX512_BF16")


def _convs_model(size: int = 14, input_channels: int = 32):
    """1x1 dense, 3x3 dense, 3x3 grouped (16 channels per group), depthwise 3x3, 3x3 grouped (8 per group),
    1x1 back to the input's channels, a residual add: each kind of convolution once."""
    b = GraphBuilder("convs", seed=0, opset=17)
    x = b.input("x", [1, input_channels, size, size])
    y = b.node("Relu", [conv_bn(b, x, "pw", input_channels, 64, 1)])
    y = b.node("Relu", [conv_bn(b, y, "dense", 64, 64, 3)])
    y = b.node("Relu", [conv_bn(b, y, "grouped16", 64, 64, 3, groups=4)])
    y = b.node("Relu", [conv_bn(b, y, "depthwise", 64, 64, 3, groups=64)])
    y = b.node("Relu", [conv_bn(b, y, "grouped8", 64, 64, 3, groups=8)])
    y = b.node("Add", [conv_bn(b, y, "project", 64, input_channels, 1), x])
    b.output(y, [1, input_channels, size, size])
    return b.model()


def _prepared(proto, precision, target="llvm"):
    backend = backend_for(target)
    program = lower(load_model(proto))
    return prepared(program, backend, "-vertical,-horizontal", precision, merge=False)


def _converted(program) -> set[str]:
    return {op.name.split("_")[0] for op in program.stages if BF16_CONV in (op.attrs or {})}


def test_convs_with_paired_channels_convert_and_the_others_say_why(caplog):
    if not HAS_BF16:
        pytest.skip("the host CPU lacks AVX512_BF16")
    with caplog.at_level(logging.INFO, logger="te_passes.precision_conv"):
        program = _prepared(_convs_model(), "bf16")
    assert _converted(program) == {"pw", "dense", "grouped16", "project"}
    assert "depthwise" in caplog.text and "no reduction over channels to pair" in caplog.text
    assert "grouped8" in caplog.text and "read different inputs" in caplog.text
    for op in program.stages:
        if BF16_CONV in (op.attrs or {}):
            assert all(str(t.dtype) == "uint16" for t in op.input_tensors), op.name


def test_fp32_prepare_converts_no_convolution():
    program = _prepared(_convs_model(), "fp32")
    assert not _converted(program)
    assert all(str(v.dtype) == "float32" for v in program.params.values())
    assert reduce_conv_precision(program) is not program  # the pass itself does convert them


def test_dense_weights_are_packed_in_channel_pairs_of_sixteen_filters():
    """Wp[f // 16, c // 2, r, s, f % 16, c % 2] is W[f, c, r, s] in bfloat16, whatever block layout the
    float32 weight had after the layout passes."""
    proto = _convs_model()
    weight = next(i for i in proto.graph.initializer if i.name.startswith("dense") and len(i.dims) == 4)
    w = numpy_helper.to_array(weight).astype(np.float32)
    program = reduce_conv_precision(_prepared(proto, "fp32"))
    packed = [v for n, v in program.params.items() if n.startswith("dense") and v.dtype == np.uint16]
    assert len(packed) == 1 and packed[0].shape == (64 // 16, 64 // 2, 3, 3, 16, 2)
    expected = bf16_bits(w).reshape(4, 16, 32, 2, 3, 3).transpose(0, 2, 4, 5, 1, 3)
    np.testing.assert_array_equal(packed[0], expected)


def _check_against_ort(proto, feeds, caplog):
    """The bf16 model's outputs within the bound of ONNX Runtime's, every converted conv tensorized."""
    with caplog.at_level(logging.WARNING, logger="souffle_py.schedule.bf16_conv"):
        model = souffle_py.optimize(proto, precision="bf16", quiet=True)
    assert "no vdpbf16ps schedule" not in caplog.text
    ours, reference = model.run(feeds), OnnxRuntimeModel(proto, threads=1).run(feeds)
    for output, expected in reference.items():
        error = np.abs(ours[output].astype(np.float64) - expected).max()
        assert error <= TOLERANCE * np.abs(expected).max(), f"{output}: max abs error {error:.3g}"
        assert error > 0  # bfloat16 operands do round
    return model


@needs_bf16
@pytest.mark.parametrize("size", [14, 8])
def test_tiny_conv_graphs_within_the_bf16_bound_on_vdpbf16ps(size, caplog):
    proto = _convs_model(size)
    feeds = {"x": np.random.default_rng(0).standard_normal((1, 32, size, size)).astype(np.float32)}
    model = _check_against_ort(proto, feeds, caplog)
    assert "vdpbf16ps" in _asm(model)


@needs_bf16
def test_a_conv_of_the_nchw_model_input_reads_a_paired_copy(caplog):
    """A 1x1 conv of the NCHW model input (no pad to block it): channels H * W apart, so the conv reads a
    rounded copy [.., C / 2, H, W, 2]."""
    b = GraphBuilder("nchw", seed=0, opset=17)
    x = b.input("x", [1, 16, 12, 12])
    b.output(b.node("Relu", [conv_bn(b, x, "conv", 16, 32, 1)]), [1, 32, 12, 12])
    proto = b.model()
    program = _prepared(proto, "bf16")
    assert _converted(program) == {"conv"}
    assert any(op.name.endswith("_bf16p16") and "pairs" in op.name for op in program.stages)
    feeds = {"x": np.random.default_rng(2).standard_normal((1, 16, 12, 12)).astype(np.float32)}
    assert "vdpbf16ps" in _asm(_check_against_ort(proto, feeds, caplog))


@needs_bf16
@pytest.mark.parametrize("name", ["resnext", "efficientnet"])
def test_tiny_conv_networks_run_their_convs_on_vdpbf16ps(name, caplog):
    """ResNeXt's dense, 1x1 and 16-channel-group convs and EfficientNet's expand convs convert; the model
    stays within the bf16 bound (test_precision.py checks every model's bound as well)."""
    proto = build_model(name, tiny=True)
    program = _prepared(proto, "bf16")
    assert sum(BF16_CONV in (op.attrs or {}) for op in program.stages) >= 5
    feeds = {i.name: np.random.default_rng(4).standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim])
             .astype(np.float32) for i in proto.graph.input}
    assert "vdpbf16ps" in _asm(_check_against_ort(proto, feeds, caplog))


@needs_bf16
def test_a_conv_with_an_nchw_output_transposes_its_accumulators(caplog):
    """The model's output keeps NCHW: the tile's 16-lane accumulators are laid out channel-innermost and
    transposed on the way out (48 filters: three single-vector blocks)."""
    b = GraphBuilder("nchw_out", seed=0, opset=17)
    x = b.input("x", [1, 32, 10, 10])
    y = b.node("Relu", [conv_bn(b, x, "first", 32, 32, 3)])
    b.output(b.node("Conv", [y, b.weight("w", [48, 32, 3, 3])], name="last", pads=[1, 1, 1, 1]), [1, 48, 10, 10])
    proto = b.model()
    program = _prepared(proto, "bf16")
    last = [op for op in program.stages if BF16_CONV in (op.attrs or {}) and op.name.startswith("last")]
    assert len(last) == 1 and [int(d) for d in last[0].output(0).shape] == [1, 48, 10, 10]
    feeds = {"x": np.random.default_rng(3).standard_normal((1, 32, 10, 10)).astype(np.float32)}
    assert "vdpbf16ps" in _asm(_check_against_ort(proto, feeds, caplog))


def test_a_conv_the_pass_does_not_understand_stays_float32(monkeypatch, caplog):
    """Whatever goes wrong in recognizing a convolution leaves it float32, with the reason logged. Laid out
    for an AVX512_BF16 CPU (32-channel blocks), the only kind the pass serves; nothing runs."""
    import te_passes.precision_conv as precision_conv

    def unforeseen(*_):
        raise IndexError("an index form not foreseen")
    monkeypatch.setattr(precision_conv, "_dense_weight", unforeseen)
    with caplog.at_level(logging.INFO, logger="te_passes.precision_conv"):
        program = reduce_conv_precision(_prepared(_convs_model(), "fp32", SPR))
    assert not _converted(program)
    assert "dense_conv_c32 stays float32: not understood (IndexError: an index form not foreseen)" in caplog.text
