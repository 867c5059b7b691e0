"""The int8 dot product's operand layouts on targets that emulate it with vpmaddwd pairs (AVX2, AVX512BW
without VNNI: te_passes/dot_weights.py, schedule/int8_dot.py): weights split once at packing time, GEMM and
channel-lane conv activations widened to int16 quads in memory, so the micro-kernel's loop splits nothing.
Exactness on such a host: test_int8.py::test_an_avx2_build_sums_exactly_on_vpmaddwd_pairs."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest

import souffle_py
from souffle_py.cpu_features import host_features
from souffle_py.cpu_target import using
from souffle_py.frontend import load_model, lower
from souffle_py.passes import conv_weights_blocked
from souffle_py.schedule.int8_dot import (EXACT_NOTE, SATURATING_NOTE, SATURATING_ZERO_POINT, int8_notes, int8_option,
                                         saturation_allowed)
from te_passes import dot_weights
from te_passes.int8_gemm import INT8_GEMM, WIDE_INPUT
from te_passes.int8_conv_vnni import INT8_CONV, PIXEL_LANES
from te_passes.integer_kernels import integer_kernels

sys.path.insert(0, str(Path(__file__).parent))
from int8_models import conv_net, mlp, quantized, random_feeds  # noqa: E402

HASWELL = "llvm -mcpu=haswell"


class _Indexed:
    def __init__(self, array):
        self.array = array

    def __getitem__(self, index):
        return self.array[index]


@pytest.mark.parametrize("layout,shape,dtype", [
    (dot_weights.PLAIN, (3, 8, 4), np.int8),
    (dot_weights.EVEN_ODD_PIXELS, (3, 8, 2, 2), np.int16), (dot_weights.LOW_HIGH, (3, 2, 8, 2), np.int16)])
def test_every_layout_reads_back_the_value_it_packed(layout, shape, dtype):
    blocks = np.random.default_rng(0).integers(-128, 128, (3, 8, 4)).astype(np.int8)
    packed = dot_weights.pack(blocks, layout)
    assert packed.shape == shape and packed.dtype == dtype and packed.flags.c_contiguous
    for outer in range(3):
        for lane in range(8):
            for depth in range(4):
                assert dot_weights.read(_Indexed(packed), [outer], lane, depth, layout) == blocks[outer, lane, depth]


def test_halves_hold_what_one_vpmaddwd_multiplies():
    """LOW_HIGH: half 1 of lane i is its depths (2, 3), the second 32-bit pair of an activation quad widened
    in memory; EVEN_ODD_PIXELS: one lane's depths (0, 2) and (1, 3), its input's even and odd bytes."""
    blocks = np.arange(32, dtype=np.int8).reshape(8, 4)
    assert dot_weights.pack(blocks, dot_weights.LOW_HIGH)[1, 1].tolist() == [6, 7]
    assert dot_weights.pack(blocks, dot_weights.EVEN_ODD_PIXELS)[1].tolist() == [[4, 6], [5, 7]]


@pytest.mark.parametrize("builder", [mlp, conv_net], ids=["mlp", "conv_net"])
def test_split_targets_pack_int16_weights_and_widen_the_gemm_and_conv_inputs(tmp_path, builder):
    program = lower(load_model(quantized(builder(), str(tmp_path), per_channel=True)))
    program = integer_kernels(conv_weights_blocked(program) if builder is conv_net else program, 8, split=True)
    kernels = [op for op in program.stages if int((op.attrs or {}).get(INT8_GEMM, (op.attrs or {}).get(INT8_CONV, 0))) == 8]
    assert kernels
    for op in kernels:
        weights = [t for t in op.input_tensors if t.op.name.endswith("_weight_vnni")]
        assert weights and all(str(t.dtype) == "int16" for t in weights)
        wide = int(op.attrs.get(WIDE_INPUT, 0)) == 1
        assert wide == (PIXEL_LANES not in op.attrs)  # pixel lanes split their uint8 quads in the kernel
        quads = [t for t in op.input_tensors if t.op.name.endswith("_input_quads")]
        assert all(str(t.dtype) == "int16" for t in quads) and (bool(quads) or not wide)


@pytest.mark.parametrize("builder", [mlp, conv_net], ids=["mlp", "conv_net"])
def test_an_avx2_kernel_loop_splits_no_weight(tmp_path, builder):
    """Compiled for Haswell whatever the host: the loops that multiply (vpmaddwd) sign-extend no weight
    byte (vpsllw / vpsraw: three per weight vector before), and the GEMM's and channel-lane conv's loops
    split no activation byte either (vpand / vpsrlw)."""
    path = quantized(builder(), str(tmp_path), per_channel=True)
    compiled = souffle_py.optimize(path, target=HASWELL, quiet=True, cache=False)
    module = compiled._module
    asm = getattr(module, "mod", module).inspect_source("asm")
    loops = [block for block in re.split(r"\n(?=\.LBB)", asm) if "vpmaddwd" in block]
    assert loops
    assert not any("vpsraw" in block or "vpsllw" in block for block in loops)
    assert any("vpand" not in block and "vpsrlw" not in block and block.count("vpmaddwd") >= 4 for block in loops)


def test_a_row_without_a_divisor_takes_one_vector_of_channels_over_its_pixels():
    from souffle_py.schedule.bf16_conv import row_pixels, tile_pixels
    with using(HASWELL):  # 16 registers: 3 pixels of 2 split vectors; 7 x 7 maps had 1-pixel tiles
        assert tile_pixels(2, 2) == 3 and row_pixels(2) == 12
    with using("llvm -mcpu=sapphirerapids"):
        assert row_pixels(1) == 30


def test_gemm_column_chunks_keep_their_weights_within_l2_chunk_bytes():
    from souffle_py.schedule.int8_gemm import _columns_per_chunk
    from souffle_py.schedule.thresholds import L2_CHUNK_BYTES
    with using(HASWELL):  # int16 pairs: a 768-deep tile of 16 columns is 24 KiB
        per = _columns_per_chunk(48, 192 * 16)
        assert per == 8 and per * 192 * 16 * 4 * 2 <= L2_CHUNK_BYTES
    with using("llvm -mcpu=sapphirerapids"):  # vpdpbusd's int8: twice the columns
        assert _columns_per_chunk(24, 192 * 32) == 8


def test_gemms_reading_one_activation_share_its_widened_copy(tmp_path):
    """BERT's Q, K and V projections read one quantized activation: one int16 copy of it, not three (the
    horizontal pass can then stack the three GEMMs, as it does their vpdpbusd forms)."""
    from models.registry import build_model
    program = lower(load_model(quantized(build_model("bert", tiny=True), str(tmp_path), mode="dynamic")))
    program = integer_kernels(program, 8, split=True)
    gemms = [op for op in program.stages if int((op.attrs or {}).get(WIDE_INPUT, 0)) == 1]
    copies = {t.op.name for op in gemms for t in op.input_tensors if t.op.name.endswith("_input_quads")}
    per_layer = 4  # the attention's input (Q, K and V), its output projection, and the two FFN GEMMs' inputs: 4
    assert gemms and len(copies) < len(gemms) and len(copies) == per_layer * len(gemms) // 6


def _transposed_gemm():
    """y = Gemm(DQ(Q(x)), DQ(w), transA=1): the activation's depth is its first axis, not its last."""
    from onnx import TensorProto, helper, numpy_helper
    from int8_models import IR_VERSION, OPSET
    rng = np.random.default_rng(0)
    constants = {"wq": rng.integers(-127, 128, (64, 32)).astype(np.int8), "xs": np.array(0.02, np.float32),
                 "xz": np.array(128, np.uint8), "ws": np.array(0.01, np.float32), "wz": np.array(0, np.int8)}
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
             helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"]),
             helper.make_node("Gemm", ["xd", "wd"], ["y"], transA=1)]
    graph = helper.make_graph(nodes, "transposed_gemm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 32])],
                              [numpy_helper.from_array(v, k) for k, v in constants.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION)


@pytest.mark.parametrize("target,mnemonic,split", [(HASWELL, "vpmaddwd", True),
                                                   ("llvm -mcpu=sapphirerapids", "vpdpbusd", False)])
def test_a_gemm_reading_its_activation_transposed_reads_a_copy_with_depth_last(target, mnemonic, split):
    """The dot product reads four consecutive depths: a Gemm's transA activation gets a layout copy with k
    last (int16 quads where the target splits its operands), so the micro-kernel tensorizes (it ran as a
    plain reduction on every target, with a warning only; make test's strict mode now raises there)."""
    model = _transposed_gemm()
    with using(target):
        program = integer_kernels(lower(load_model(model)), 16 if "sapphire" in target else 8, split=split)
    gemm = next(op for op in program.stages if INT8_GEMM in (op.attrs or {}))
    copy = gemm.input_tensors[0]
    assert [int(d) for d in copy.shape] == ([8, 16, 4] if split else [8, 64]) and str(copy.dtype) == (
        "int16" if split else "uint8")
    compiled = souffle_py.optimize(model, target=target, quiet=True, cache=False)
    asm = compiled._module.mod.inspect_source("asm") if hasattr(compiled._module, "mod") else \
        compiled._module.inspect_source("asm")
    assert mnemonic in asm
    if set(compiled.plan.cpu_features) - (host_features() or set()):
        return  # compiled only: the host cannot run this target's code
    import onnxruntime as ort
    x = (np.random.default_rng(1).standard_normal((64, 8)) * 2).astype(np.float32)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # the operators one by one
    want = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(compiled.run({"x": x})["y"], want, rtol=0, atol=1e-6 * np.abs(want).max())


def test_pairs_bounded_is_vpmaddubsws_no_saturation_condition():
    """Depths (0, 1) and (2, 3) of a lane are the pairs vpmaddubsw sums: |w0| + |w1| <= 128 keeps 255 x
    that within int16 for every uint8 activation."""
    blocks = np.zeros((2, 8, 4), np.int8)
    blocks[1, 3] = [64, -64, -128, 0]  # both pairs exactly at the bound
    assert dot_weights.pairs_bounded(blocks)
    blocks[1, 3, 3] = 1  # (-128, 1): 129
    assert not dot_weights.pairs_bounded(blocks)
    blocks[1, 3] = [127, 0, 0, 127]  # large values in different pairs are fine
    assert dot_weights.pairs_bounded(blocks)


@pytest.mark.parametrize("builder", [mlp, conv_net], ids=["mlp", "conv_net"])
def test_reduce_range_weights_take_the_saturating_form_and_stay_exact(tmp_path, builder):
    """ONNX Runtime's reduce_range quantizes weights to 7 bits (|w| <= 64): no pair can saturate, so an AVX2
    target packs them as int8 quads (NARROW_PAIRS) and sums them with vpmaddubsw, exactly: the file's
    operators one by one (ONNX Runtime, graph optimizations off), bit for bit; the plan has no saturation
    note. Full-range weights keep the exact vpmaddwd form (the other tests here)."""
    import onnxruntime as ort
    fp32 = builder()
    path = quantized(fp32, str(tmp_path), activations="uint8", per_channel=True, reduce_range=True)
    with using(HASWELL):
        program = integer_kernels(conv_weights_blocked(lower(load_model(path))), 8, split=True)
    marked = [op for op in program.stages if int((op.attrs or {}).get(dot_weights.NARROW_PAIRS, 0))]
    assert marked and not any(int((op.attrs or {}).get(WIDE_INPUT, 0)) for op in marked)
    compiled = souffle_py.optimize(path, target=HASWELL, quiet=True, cache=False)
    asm = compiled._module.mod.inspect_source("asm") if hasattr(compiled._module, "mod") else \
        compiled._module.inspect_source("asm")
    assert "vpmaddubsw" in asm and SATURATING_NOTE not in compiled.plan.notes
    if "avx2" not in (host_features() or set()):
        return
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    reference = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    for seed in (0, 4):
        feeds = random_feeds(fp32, seed)
        np.testing.assert_array_equal(list(compiled.run(feeds).values())[0], reference.run(None, feeds)[0])


def test_pair_form_splits_unless_the_weights_or_the_compile_allow_the_saturating_form():
    """Before/expected: a split target's stage stays split unless its weights cannot saturate (NARROW_PAIRS)
    or int8="saturating" lets its activations' zero point saturate (SATURATING_PAIRS); a target whose dot
    product does not split (vpdpbusd) is left alone."""
    full, seven_bits = np.full((1, 8, 4), 127, np.int8), np.full((1, 8, 4), 64, np.int8)
    assert dot_weights.pair_form(False, full, 0, lambda zero: True) == (False, {})
    assert dot_weights.pair_form(True, seven_bits, 128) == (False, {dot_weights.NARROW_PAIRS: 1})
    split_at = lambda zero: (True, {dot_weights.SPLIT_ZERO_POINT: zero})  # noqa: E731  (split, its zero point kept)
    assert dot_weights.pair_form(True, full, 0) == split_at(0)
    with int8_option("saturating"):
        assert dot_weights.pair_form(True, full, 0, saturation_allowed) == (False, {dot_weights.SATURATING_PAIRS: 1})
        assert dot_weights.pair_form(True, full, None, saturation_allowed)[1] == {dot_weights.SATURATING_PAIRS: 1}
        assert saturation_allowed(SATURATING_ZERO_POINT) and not saturation_allowed(SATURATING_ZERO_POINT + 1)
        assert dot_weights.pair_form(True, full, 128, saturation_allowed) == split_at(128)
    assert dot_weights.pair_form(True, full, 0, saturation_allowed) == split_at(0)  # "exact": nothing saturates
    assert dot_weights.pair_form(True, full, None, saturation_allowed) == split_at(dot_weights.RUN_TIME)


def test_saturating_compiles_keep_zero_centred_gemms_exact(tmp_path):
    """int8="saturating" on an MLP whose input is zero-centred (uint8 zero point near 128): the first GEMM
    keeps the exact split form, the two reading ReLU outputs (zero point 0) take the saturating one."""
    path = quantized(mlp(), str(tmp_path), activations="uint8", per_channel=True)
    with using(HASWELL), int8_option("saturating"):
        program = integer_kernels(lower(load_model(path)), 8, split=True, may_saturate=saturation_allowed)
    gemms = [op for op in program.stages if int((op.attrs or {}).get(INT8_GEMM, 0)) > 1]
    saturating = [op for op in gemms if int(op.attrs.get(dot_weights.SATURATING_PAIRS, 0))]
    exact = [op for op in gemms if int(op.attrs.get(WIDE_INPUT, 0))]
    assert len(gemms) == 3 and len(saturating) == 2 and len(exact) == 1
    assert int8_notes(program.stages) == (SATURATING_NOTE,)  # the zero-centred GEMM could not saturate anyway


def test_an_exact_compile_says_which_stages_saturating_would_change(tmp_path):
    """The default on a CPU without VNNI: the plan notes how many stages int8="saturating" would give the
    saturating form (the MLP's two GEMMs reading ReLU outputs, not the zero-centred first one), and
    describe() prints it; a VNNI build and a saturating one have no such note."""
    path = quantized(mlp(), str(tmp_path), activations="uint8", per_channel=True)
    with using(HASWELL):
        program = integer_kernels(lower(load_model(path)), 8, split=True, may_saturate=saturation_allowed)
    split = [op for op in program.stages if dot_weights.SPLIT_ZERO_POINT in (op.attrs or {})]
    assert len(split) == 3 and sorted(int(op.attrs[dot_weights.SPLIT_ZERO_POINT]) > 64 for op in split) == [
        False, False, True]
    assert int8_notes(program.stages) == (EXACT_NOTE.format(count=2),)
    compiled = souffle_py.optimize(path, target=HASWELL, quiet=True, cache=False)
    assert EXACT_NOTE.format(count=2) in compiled.plan.notes and "would give them vpmaddubsw" in compiled.describe()
    saturating = souffle_py.optimize(path, target=HASWELL, int8="saturating", quiet=True, cache=False)
    vnni = souffle_py.optimize(path, target="llvm -mcpu=alderlake", quiet=True, cache=False)
    assert not any(note.startswith('int8="exact"') for note in saturating.plan.notes + vnni.plan.notes)
