"""int8 1 x 1 convolutions with their lanes over output pixels (te_passes/int8_conv_vnni.py `pixel_lanes`,
schedule/int8_pixel_conv.py): which convolutions take the form, the tile from the target's registers, the
requantizing epilogue (a residual add included) computed in the write-back, and the values against ONNX
Runtime."""

from __future__ import annotations

import re

import numpy as np
import pytest
from onnx import TensorProto, helper

import souffle_py
from int8_models import IR_VERSION, OPSET, _weight, conv_net, quantized
from souffle_py.cpu_target import using
from souffle_py.frontend import load_model, lower
from souffle_py.passes import conv_weights_blocked
from souffle_py.schedule.blocks import vector_registers
from souffle_py.schedule.int8_dot import dot4
from te_passes.int8_conv_vnni import PIXEL_LANES
from te_passes.integer_kernels import integer_kernels
from test_cpu_target import HASWELL, SPR, ZNVER5
from test_int8 import DOT_LANES, DOT_MNEMONIC, HOST_DOT, _asm, assert_within_one_step, needs_dot


def _one_conv(size: int, stride: int = 1, kernel: int = 1, channels: int = 32) -> object:
    rng = np.random.default_rng(0)
    out = (size - 1) // stride + 1
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "W", "B"], ["c"], strides=[stride, stride],
                          pads=[kernel // 2] * 4),
         helper.make_node("Relu", ["c"], ["y"])], "one_conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, channels, size, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 48, out, out])],
        [_weight(rng, "W", (48, channels, kernel, kernel), 0.2), _weight(rng, "B", (48,), 0.1)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION)


def _pixel_convs(path) -> list:
    program = integer_kernels(conv_weights_blocked(lower(load_model(path))), vnni_lanes=16)
    return [op for op in program.stages if PIXEL_LANES in (op.attrs or {})]


@pytest.mark.parametrize("size,stride,kernel,pixels", [(8, 1, 1, 64), (14, 1, 1, 208), (7, 1, 1, 64), (3, 1, 1, 0),
                                                       (8, 2, 1, 16), (8, 1, 3, 0)],
                         ids=["1x1", "padded-map", "7x7-map", "ragged-map", "strided", "3x3"])
def test_only_1x1_convs_of_nearly_whole_pixel_vectors_take_pixel_lanes(tmp_path, size, stride, kernel, pixels):
    """8 x 8 = 4 vectors; 14 x 14 = 196 pixels padded to 208 (6%), 7 x 7 = 49 to 64 (31%); 3 x 3 would pad
    9 to 16 (78%); a
    stride 2 conv over 8 x 8 has 4 x 4 output pixels, its quads a subsampled copy."""
    fp32 = _one_conv(size, stride, kernel)
    path = quantized(fp32, str(tmp_path), per_channel=True)
    found = _pixel_convs(path)
    assert len(found) == int(pixels > 0)
    if pixels:  # [N, F, P], reading the input quads [N, C / 4, P, 4]
        assert [int(d) for d in found[0].output(0).shape] == [1, 48, pixels]
        (quads,) = [t for t in found[0].input_tensors if len(t.shape) == 4]
        assert [int(d) for d in quads.shape] == [1, 8, pixels, 4]
    if size in (14, 7) or stride > 1:  # padded pixels compute zeros that no reader sees; the copy subsamples
        model = souffle_py.optimize(path, quiet=True, cache=False)
        assert_within_one_step(model, fp32, path, seeds=(0,))


@pytest.mark.parametrize("target", [HASWELL, SPR, ZNVER5])
def test_the_pixel_tile_fits_the_targets_registers(target):
    from souffle_py.schedule.int8_pixel_conv import tile_shape

    with using(target):
        per = dot4().operand_registers  # 2 where each operand is split in halves (AVX2's vpmaddwd pairs)
        for pixel_vectors, channels in [(196, 256), (49, 64), (4, 48), (1, 1000)]:
            ch, vectors = tile_shape(pixel_vectors, channels)
            assert channels % ch == 0 and pixel_vectors % vectors == 0
            assert (ch + per) * vectors <= vector_registers() - per
        assert tile_shape(196, 256) == ((4, 4) if vector_registers() == 32 else (4, 2))


@pytest.mark.parametrize("target", [HASWELL, SPR, ZNVER5])
def test_the_pixel_tiles_input_panel_stays_in_the_targets_l1(target):
    """Every channel tile reads the pixel tile's input panel again: at 512 input channels (128 quads) a
    panel of 7 vectors is 56 KiB, beyond any of these L1d; the tile takes fewer vectors where one fits."""
    from souffle_py.cpu_target import CpuTarget
    from souffle_py.schedule.int8_pixel_conv import tile_shape
    from souffle_py.schedule.thresholds import PIXEL_PANEL_L1_SHARE

    with using(target):
        budget = PIXEL_PANEL_L1_SHARE * CpuTarget.current().l1d_bytes
        lanes, per = dot4().lanes, dot4().operand_registers
        for quads in (16, 128, 256):
            ch, vectors = tile_shape(50, 128, quads)
            assert quads * vectors * lanes * 4 <= budget
            assert 128 % ch == 0 and 50 % vectors == 0 and (ch + per) * vectors <= vector_registers() - per
        assert tile_shape(49, 128, 128)[1] == 1  # 7 vectors do not fit: 1, not 7 (the padding gives 50)


def test_an_odd_count_of_pixel_vectors_is_padded_to_an_even_one_only_where_no_tile_fits_l1():
    from te_passes.int8_conv_vnni import _padded_pixels

    with using(SPR):  # 48 KiB of L1d
        assert _padded_pixels(28 * 28, 16, 128) == 800   # 49 vectors: 7 x 4 KiB of panel at 512 channels: 50
        assert _padded_pixels(28 * 28, 16, 32) == 784    # at 128 channels 7 vectors fit: unpadded
        assert _padded_pixels(56 * 56, 16, 128) == 3136  # 196: 2 or 4 vectors fit
        assert _padded_pixels(14 * 14, 16, 256) == 224   # 13 vectors, none fits: 14 (14% more)
        assert _padded_pixels(14 * 14, 16, 32) == 208    # a tile of 13 fits at 128 channels: 13 (6%)
        assert _padded_pixels(7 * 7, 16, 16) == 64       # 64 for 49: 31% padding, in PIXEL_PADDING
        assert _padded_pixels(3 * 3, 16, 16) == 0        # 16 for 9: the channels stay in the lanes


@needs_dot
@pytest.mark.parametrize("activations", ["int8", "uint8"])
def test_a_pixel_conv_with_its_residual_add_in_the_write_back_matches_onnxruntime(tmp_path, activations):
    """conv_net's last conv (1 x 1, 16 -> 16 at 8 x 8) plus the residual add: vpdpbusd over 16 pixels (or the
    host's dot product over its lanes) with
    the weight quad broadcast, no int32 map of its sum (the requantizing add is computed in the write-back),
    within one quantization step of ONNX Runtime (the QDQ residual add: test_int8.py)."""
    fp32 = conv_net()
    path = quantized(fp32, str(tmp_path), activations=activations, per_channel=True)
    assert len(_pixel_convs(path)) == 1
    model = souffle_py.optimize(path, quiet=True, cache=False)
    assert DOT_MNEMONIC in _asm(model)
    scripts = "\n".join(f.script() for f in model.scheduled_functions.values())
    # the pixel form's instruction: a vector of pixels x 4 channels loaded (a), one weight quad broadcast (b;
    # split: its even and odd int16 pairs, each broadcast)
    weight = (rf"T\.Broadcast\(even, {DOT_LANES}\), T\.Broadcast\(odd, {DOT_LANES}\)" if HOST_DOT.split_weights
              else rf"T\.Broadcast\(quad, {DOT_LANES}\)")
    assert re.search(rf'"{HOST_DOT.function}", c\[[^\]]*\], T\.reinterpret\("int32x{DOT_LANES}", a\[.*'
                     rf'{weight}\)', scripts)
    sums = re.findall(r"= T\.sblock_alloc_buffer\(\(1, 16, 64\), \"int32\"(.*)\)", scripts)
    assert sums and all("local" in rest for rest in sums)  # the sum's tile only, in registers
    assert_within_one_step(model, fp32, path)


@needs_dot
def test_a_batch_of_two_keeps_each_images_pixels(tmp_path):
    """Batch 2: the quads and sums [N, ., P, .] hold each image's pixels apart (a 1 x 1 conv, then a strided
    one over its requantized output); the values equal ONNX Runtime's."""
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "W", "B"], ["c"]), helper.make_node("Relu", ["c"], ["r"]),
         helper.make_node("Conv", ["r", "W2"], ["c2"], strides=[2, 2]), helper.make_node("Relu", ["c2"], ["y"])],
        "batch2", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 32, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 48, 4, 4])],
        [_weight(rng, "W", (32, 32, 1, 1), 0.2), _weight(rng, "B", (32,), 0.1), _weight(rng, "W2", (48, 32, 1, 1), 0.2)])
    fp32 = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION)
    path = quantized(fp32, str(tmp_path), per_channel=True)
    assert [int(op.output(0).shape[0]) for op in _pixel_convs(path)] == [2, 2]
    model = souffle_py.optimize(path, quiet=True, cache=False)
    assert_within_one_step(model, fp32, path)
