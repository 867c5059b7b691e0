"""QDQ max pools pooled in int8 (te_passes/int8_pool.py): DequantizeLinear -> MaxPool -> QuantizeLinear at
one scale and zero point becomes a max over the int8 map, a strided pool reading a phase-split copy of its
padded input; the values stay ONNX Runtime's."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import souffle_py
from int8_models import IR_VERSION, OPSET, _weight, quantized
from souffle_py.frontend import load_model, lower
from souffle_py.passes import conv_weights_blocked
from te_passes.integer_kernels import integer_kernels
from te_passes.quant import QUANTIZE_TAG
from test_int8 import assert_within_one_step


def _conv_pool_conv(kernel: int, stride: int, pad: int, size: int = 16):
    rng = np.random.default_rng(0)
    pooled = (size + 2 * pad - kernel) // stride + 1
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "W1", "B1"], ["c1"], pads=[1, 1, 1, 1]),
         helper.make_node("Relu", ["c1"], ["r1"]),
         helper.make_node("MaxPool", ["r1"], ["p"], kernel_shape=[kernel, kernel], strides=[stride, stride],
                          pads=[pad] * 4),
         helper.make_node("Conv", ["p", "W2"], ["y"])], "pool",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, size, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, pooled, pooled])],
        [_weight(rng, "W1", (16, 3, 3, 3), 0.3), _weight(rng, "B1", (16,), 0.1), _weight(rng, "W2", (16, 16, 1, 1), 0.2)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION)


@pytest.mark.parametrize("kernel,stride,pad", [(3, 2, 1), (2, 2, 0), (3, 1, 1)], ids=["resnet-stem", "unpadded", "stride-1"])
def test_a_qdq_max_pool_pools_the_int8_map_and_matches_onnxruntime(tmp_path, kernel, stride, pad):
    fp32 = _conv_pool_conv(kernel, stride, pad)
    path = quantized(fp32, str(tmp_path), per_channel=True)
    program = integer_kernels(conv_weights_blocked(lower(load_model(path))), vnni_lanes=16)
    pools = [op for op in program.stages if QUANTIZE_TAG in (op.attrs or {}) and op.reduce_axis]
    assert len(pools) == 1 and str(pools[0].output(0).dtype) == "int8"  # the pool itself, on int8
    assert not any(op.reduce_axis and str(op.output(0).dtype) == "float32" and "pool" in op.name.lower()
                   for op in program.stages)
    assert not [op for op in program.stages if op.name.endswith("_phases")]  # channels-last after a VNNI conv
    plain = integer_kernels(conv_weights_blocked(lower(load_model(path))), vnni_lanes=0)  # the int32 conv
    phases = [op for op in plain.stages if op.name.endswith("_phases")]
    assert len(phases) == int(stride > 1 and pad > 0)  # a padded strided pool reads a phase-split copy
    if phases:
        assert [int(d) for d in phases[0].output(0).shape][-2:] == [stride, -(-(16 + 2 * pad) // stride)]
    model = souffle_py.optimize(path, quiet=True, cache=False)
    assert_within_one_step(model, fp32, path)


def test_a_pool_requantized_at_another_scale_stays_float32(tmp_path):
    """Only a pool quantized back at its input's scale and zero point is the int8 max of that map."""
    fp32 = _conv_pool_conv(3, 2, 1)
    path = quantized(fp32, str(tmp_path), per_channel=True)
    import onnx
    from onnx import numpy_helper
    model = onnx.load(path)
    pool = next(n for n in model.graph.node if n.op_type == "MaxPool")
    q = next(n for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == pool.output[0])
    scale = next(i for i in model.graph.initializer if i.name == q.input[1])
    doubled = numpy_helper.from_array(numpy_helper.to_array(scale) * 2, scale.name + "_doubled")
    model.graph.initializer.append(doubled)
    q.input[1] = doubled.name
    onnx.save(model, str(tmp_path / "other_scale.onnx"))
    program = integer_kernels(conv_weights_blocked(lower(load_model(str(tmp_path / "other_scale.onnx")))),
                              vnni_lanes=16)
    assert not [op for op in program.stages if QUANTIZE_TAG in (op.attrs or {}) and op.reduce_axis]


def test_an_int8_pool_row_is_one_vector(tmp_path):
    """An unpadded 2 x 2 pool of stride 1, 57 x 57 -> 56 x 56: each 56-byte output row one vector
    (schedule/reductions.py; two of 28 bytes with AVX2), not 7 vectors of 8 lanes; within one step of ONNX
    Runtime."""
    fp32 = _conv_pool_conv(2, 1, 0, size=57)
    path = quantized(fp32, str(tmp_path), per_channel=True)
    model = souffle_py.optimize(path, quiet=True, cache=False)
    script = "\n".join(f.script() for f in model.scheduled_functions.values())
    from souffle_py.schedule.reductions import _narrow_row
    assert _narrow_row(56, "int8") in (56, 28)  # one 512-bit vector, or two halves of 256-bit ones (AVX2)
    assert f"T.vectorized({_narrow_row(56, 'int8')})" in script and "(1, 16, 56, 56), \"int8\"" in script
    assert_within_one_step(model, fp32, path)


@pytest.mark.parametrize("size", [112, 15])
def test_a_padded_strided_pool_after_a_channel_lane_conv_runs_channels_last(tmp_path, size):
    """ResNet's stem: 3 x 3 conv (channels in the lanes) -> 3 x 3 / 2 pool padded by 1. The conv writes its
    requantized map NHWC (no int32 map, no pad, no phase-split copy), the pool [1, OH, OW, 16] reads a
    channel vector per tap; within one step of ONNX Runtime (an odd size: taps past the map's edge)."""
    fp32 = _conv_pool_conv(3, 2, 1, size=size)
    path = quantized(fp32, str(tmp_path), per_channel=True)
    program = integer_kernels(conv_weights_blocked(lower(load_model(path))), vnni_lanes=16)
    assert not [op for op in program.stages if op.name.endswith("_phases")]
    pooled = (size + 2 - 3) // 2 + 1
    model = souffle_py.optimize(path, quiet=True, cache=False)
    script = "\n".join(f.script() for f in model.scheduled_functions.values())
    assert f"({1}, {size}, {size}, 16), \"int8\"" in script and f"(1, {pooled}, {pooled}, 16), \"int8\"" in script
    assert f"(1, 16, {size}, {size}), \"int32\"" not in script
    assert_within_one_step(model, fp32, path)
