"""The int8 maps between two convolutions: a channel-lane conv whose requantized map only input-quad copies
read writes it NHWC, requantized in its write-back (schedule/int8_conv.py), the copies computed in its
tiles (schedule/rules/layout_copy.py); a pixel-lane conv's
requantization read by a pad stays a TE of its own (te_passes/vertical.py), computed in the conv's
write-back, the pad a plain int8 copy. Values against ONNX Runtime."""

from __future__ import annotations

import re

import numpy as np
import pytest
from onnx import TensorProto, helper

import souffle_py
from int8_models import IR_VERSION, OPSET, _weight, quantized
from souffle_py.ir.exprs import is_pad_value
from test_int8 import DOT_LANES, DOT_MNEMONIC, _asm, assert_within_one_step, needs_dot


def _two_convs(first: int, second: int, size: int = 8, channels: int = 16) -> object:
    """x -> conv (first x first) -> relu -> conv (second x second) -> relu: the first conv's requantized
    map read only by the second."""
    rng = np.random.default_rng(0)
    nodes, inits, current = [], [], "x"
    for i, (kernel, cin) in enumerate(((first, 8), (second, channels))):
        inits += [_weight(rng, f"W{i}", (channels, cin, kernel, kernel), 0.2), _weight(rng, f"B{i}", (channels,), 0.1)]
        nodes += [helper.make_node("Conv", [current, f"W{i}", f"B{i}"], [f"c{i}"], pads=[kernel // 2] * 4),
                  helper.make_node("Relu", [f"c{i}"], [f"r{i}"])]
        current = f"r{i}"
    graph = helper.make_graph(nodes, "two_convs",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, size, size])],
                              [helper.make_tensor_value_info(current, TensorProto.FLOAT, [1, channels, size, size])],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION)


def _scripts(model) -> str:
    return "\n".join(f.script() for f in model.scheduled_functions.values())


@needs_dot
@pytest.mark.parametrize("channels_last", [True, False])
def test_a_3x3_conv_read_only_by_a_1x1_conv_writes_its_requantized_map_nhwc(tmp_path, channels_last, monkeypatch):
    """3 x 3 (channels in the lanes) -> 1 x 1 (pixels in the lanes, through its input quads): the 3 x 3 conv's
    map [1, 8, 8, 16] NHWC int8, no int32 NCHW map of its sums, the requantization in the write-back of
    whole channel vectors; NCHW with CHANNELS_LAST off. Both within one step of ONNX Runtime."""
    import souffle_py.schedule.int8_conv as int8_conv

    import souffle_py.backends.cpu as cpu_backend

    monkeypatch.setattr(int8_conv, "CHANNELS_LAST", channels_last)
    monkeypatch.setattr(cpu_backend, "_one_thread", lambda kernels: False)  # tiles in parallel, as a real model's
    fp32 = _two_convs(3, 1)
    path = quantized(fp32, str(tmp_path), per_channel=True)
    model = souffle_py.optimize(path, quiet=True, cache=False)
    scripts = _scripts(model)
    nhwc = re.findall(r"T\.sblock_alloc_buffer\(\(1, 8, 8, 16\), \"int8\"\)", scripts)
    nchw_sums = re.findall(r"T\.sblock_alloc_buffer\(\(1, 16, 8, 8\), \"int32\"\)", scripts)
    if channels_last:
        assert nhwc and not nchw_sums
    else:
        assert not nhwc and nchw_sums
    # the 1 x 1 conv's input quads copied in the 3 x 3 conv's tiles (schedule/rules/layout_copy.py), from
    # the NHWC map; from a requantizing pass of its own (NCHW), a copy apart
    assert ("souffle.in_writer_tile" in scripts) == channels_last
    assert DOT_MNEMONIC in _asm(model)
    assert_within_one_step(model, fp32, path)


@needs_dot
@pytest.mark.parametrize("size,pixels", [(16, 256), (14, 208)])
def test_a_1x1_conv_read_by_a_padded_3x3_conv_requantizes_in_its_write_back(tmp_path, size, pixels):
    """1 x 1 (pixels in the lanes) -> pad -> 3 x 3: the pad copies int8 values (the requantization is the 1 x 1
    conv's epilogue); it read the int32 sums before (16 x 16 x 32: the vertical pass composed the
    requantization into the pad). 14 x 14: the sum padded to 208 pixels, the requantization laid over them
    (te_passes/int8_pixel_epilogue.py). Within one step of ONNX Runtime."""
    fp32 = _two_convs(1, 3, size=size, channels=32)
    path = quantized(fp32, str(tmp_path), per_channel=True)
    model = souffle_py.optimize(path, quiet=True, cache=False)
    scripts = _scripts(model)
    pads = [line for line in scripts.splitlines() if "T.if_then_else(" in line and "= T.if_then_else(" in line]
    assert pads and not any("nearbyint" in line for line in pads)  # plain copies, no requantization
    assert not re.findall(rf"T\.sblock_alloc_buffer\(\(1, 32, {pixels}\), \"int32\"\)", scripts)  # in registers
    assert_within_one_step(model, fp32, path)


def _downsampling_block(size: int = 16) -> object:
    """x -> 1 x 1 conv -> relu -> 1 x 1 conv (a), x -> 1 x 1 conv (b), a and b 64 channels, added, relu: a
    ResNet stage's first block, its last conv and its downsampling conv read by one residual add."""
    rng = np.random.default_rng(1)
    inits = [_weight(rng, "W0", (32, 32, 1, 1), 0.2), _weight(rng, "B0", (32,), 0.1),
             _weight(rng, "Wa", (64, 32, 1, 1), 0.2), _weight(rng, "Ba", (64,), 0.1),
             _weight(rng, "Wb", (64, 32, 1, 1), 0.2), _weight(rng, "Bb", (64,), 0.1)]
    nodes = [helper.make_node("Conv", ["x", "W0", "B0"], ["c0"]), helper.make_node("Relu", ["c0"], ["r0"]),
             helper.make_node("Conv", ["r0", "Wa", "Ba"], ["a"]), helper.make_node("Conv", ["x", "Wb", "Bb"], ["b"]),
             helper.make_node("Add", ["a", "b"], ["s"]), helper.make_node("Relu", ["s"], ["y"])]
    graph = helper.make_graph(nodes, "downsampling_block",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32, size, size])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64, size, size])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION)


@needs_dot
@pytest.mark.parametrize("first_kept", [True, False])
def test_the_first_of_two_added_convs_writes_its_int8_map(tmp_path, first_kept, monkeypatch):
    """Two pixel-lane 1 x 1 convs read by one residual add: the one computed first writes its requantized
    int8 map, the other's write-back computes the sum; with the rule off the first wrote its int32 sums
    [1, 64, 256] for the other to read (te_passes/vertical.py). Within one step of ONNX Runtime."""
    import te_passes.vertical as vertical

    if not first_kept:
        monkeypatch.setattr(vertical, "_first_of_two_conv_epilogues", lambda *args: False)
    fp32 = _downsampling_block()
    path = quantized(fp32, str(tmp_path), per_channel=True)
    model = souffle_py.optimize(path, quiet=True, cache=False)
    scripts = _scripts(model)
    int32_sums = re.findall(r"T\.sblock_alloc_buffer\(\(1, 64, 256\), \"int32\"\)", scripts)
    int8_map = re.findall(r"T\.sblock_alloc_buffer\(\(1, 64, 256\), \"int8\"\)", scripts)
    assert (int8_map and not int32_sums) if first_kept else (int32_sums and not int8_map)
    assert_within_one_step(model, fp32, path)


def test_is_pad_value_recognises_a_pad_and_nothing_else():
    from tvm import te, tirx

    x = te.placeholder((4, 4), "int8", name="x")
    pad = te.compute((6, 6), lambda i, j: tirx.if_then_else(
        tirx.all(i >= 1, i < 5, j >= 1, j < 5), x[i - 1, j - 1], tirx.const(0, "int8")), name="pad")
    copy = te.compute((4, 4), lambda i, j: x[i, j] + tirx.const(1, "int8"), name="copy")
    def _is_pad(op):
        return isinstance(op, te.ComputeOp) and is_pad_value(op.body[0])

    assert _is_pad(pad.op) and not _is_pad(copy.op) and not _is_pad(x.op)
