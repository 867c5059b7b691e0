"""te_passes/constant_dequantize.py: a DequantizeLinear of a constant that no integer kernel took becomes its
float32 values, equal to the TE's bit for bit; one of a computed map, or a graph output, stays a TE."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import souffle_py
from souffle_py.frontend import import_onnx
from te_passes.check import run_program
from te_passes.constant_dequantize import fold_constant_dequantize
from te_passes.quant import DEQUANTIZE_TAG
from tests.test_int8 import assert_within_one_step

sys.path.insert(0, str(Path(__file__).parent))
from int8_models import IR_VERSION, OPSET, pointwise_block, quantized, random_feeds  # noqa: E402

HASWELL = "llvm -mcpu=haswell"


def _bias_add(per_axis: bool, dtype=np.int8, dequantized_output: bool = False):
    """y = x + DequantizeLinear(b) (b an int8 or uint8 constant, scales per tensor or along axis 1), and
    DequantizeLinear(QuantizeLinear(x)) as a second output: a dequantization of a computed map."""
    rng = np.random.default_rng(3)
    info = np.iinfo(dtype)
    b = rng.integers(info.min, info.max + 1, (4, 16)).astype(dtype)
    scale = (rng.uniform(1e-3, 1e-1, 16) if per_axis else np.array(0.037)).astype(np.float32)
    zero = (rng.integers(-5, 5, 16) if per_axis else np.array(3)).astype(dtype) + (128 if dtype == np.uint8 else 0)
    inits = [numpy_helper.from_array(b, "b"), numpy_helper.from_array(scale, "b_scale"),
             numpy_helper.from_array(zero.astype(dtype), "b_zero"),
             numpy_helper.from_array(np.array(0.05, np.float32), "x_scale"),
             numpy_helper.from_array(np.array(0, np.int8), "x_zero")]
    nodes = [helper.make_node("DequantizeLinear", ["b", "b_scale", "b_zero"], ["bias"], axis=1),
             helper.make_node("Add", ["x", "bias"], ["y"]),
             helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zero"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "x_scale", "x_zero"], ["xd"])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 16]),
               helper.make_tensor_value_info("xd", TensorProto.FLOAT, [4, 16])]
    if dequantized_output:
        outputs.append(helper.make_tensor_value_info("bias", TensorProto.FLOAT, [4, 16]))
    graph = helper.make_graph(nodes, "bias_add", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
                              outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION)
    expected_bias = (b.astype(np.int32) - zero.astype(np.int32)).astype(np.float32) * scale
    return model, expected_bias


def _dequantize_tes(program) -> list[str]:
    return [op.name for op in program.stages if DEQUANTIZE_TAG in (op.attrs or {})]


@pytest.mark.parametrize("per_axis", [False, True])
@pytest.mark.parametrize("dtype", [np.int8, np.uint8])
def test_a_dequantized_constant_becomes_its_values(per_axis, dtype):
    model, expected_bias = _bias_add(per_axis, dtype)
    program = import_onnx(model)
    assert len(_dequantize_tes(program)) == 2  # the bias's and the computed map's
    folded = fold_constant_dequantize(program)
    assert len(_dequantize_tes(folded)) == 1  # the computed map's stays a TE
    added = [name for name in folded.params if name not in program.params]
    assert len(added) == 1
    np.testing.assert_array_equal(folded.params[added[0]], expected_bias)
    feeds = {"x": np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)}
    before, after = run_program(program, feeds), run_program(folded, feeds)
    for name in before:  # bit for bit: the same int32 subtraction and float32 multiply
        np.testing.assert_array_equal(after[name], before[name])


def test_a_dequantized_constant_that_is_an_output_stays_a_te():
    model, _ = _bias_add(per_axis=False, dequantized_output=True)
    program = import_onnx(model)
    assert fold_constant_dequantize(program) is program


def test_no_dequantized_constant_leaves_the_program_as_it_is():
    program = import_onnx(pointwise_block(channels=8, size=2))  # float32: no DequantizeLinear at all
    assert fold_constant_dequantize(program) is program


def test_a_qdq_linear_bias_is_a_constant_and_its_requantization_runs_in_the_gemm_write_back(tmp_path):
    """ConvNeXt's pointwise block quantized by ONNX Runtime (MatMul + Add: the bias an int8 tensor of its
    own scale) over 14 x 14 rows: no dequantization left in the kernel, the bias add and its requantization
    computed in each GEMM's write-back (no nest of its own reads the GEMM's int32 sum), within one output
    step of ONNX Runtime."""
    fp32 = pointwise_block(channels=32, size=14)
    path = quantized(fp32, str(tmp_path), per_channel=True)
    compiled = souffle_py.optimize(path, target=HASWELL, quiet=True, cache=False)
    program = compiled.program
    assert not [op.name for op in program.stages if DEQUANTIZE_TAG in (op.attrs or {})
                and all(program.placeholder_kind(t) == "param" for t in op.input_tensors)]
    for script in (f.script() for f in compiled.scheduled_functions.values()):
        nests = script.split("\n    for ")  # the root block's loop nests
        sums = [n for n in nests if "_update" in n]
        assert sums and all("T.nearbyint" in n for n in sums)  # each GEMM's nest requantizes its write-back
    assert_within_one_step(compiled, fp32, path)
