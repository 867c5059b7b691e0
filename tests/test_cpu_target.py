"""cpu_target.py: a CPU described from its TVM target (not from the compiling machine), the schedules' budgets
following it, and a model compiled for AVX2 (haswell) running on this host and matching ONNX Runtime."""

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import souffle_py
from souffle_py.baselines import OnnxRuntimeModel
from souffle_py.cpu_target import KNOWN_CPUS, CpuTarget, current, host_target, using
from souffle_py.cpu_features import host_features
from souffle_py.errors import TargetError
from souffle_py.partition import host_cpu
from souffle_py.schedule import conv
from souffle_py.schedule.blocks import vector_lanes, vector_registers
from souffle_py.schedule.budgets import gemm_accumulators, gemm_tile_columns, gemm_tile_rows, gemv_tile_lanes

HASWELL, ZNVER4, ZNVER5 = "llvm -mcpu=haswell", "llvm -mcpu=znver4", "llvm -mcpu=znver5"
SPR = "llvm -mcpu=sapphirerapids"
NEOVERSE_V1 = "llvm -mtriple=aarch64-linux-gnu -mcpu=neoverse-v1"
HAS_AVX2 = "avx2" in (host_features() or set()) and "fma" in (host_features() or set())


def test_the_host_is_read_from_this_machine():
    cpu = CpuTarget.from_target("llvm")
    assert cpu.host and cpu == CpuTarget.host_cpu() == current()
    assert cpu.cpu == host_target().attrs["mcpu"]
    flags = host_features() or set()
    assert cpu.avx512f == ("avx512f" in flags) and cpu.avx2 == ("avx2" in flags)
    assert cpu.lanes == (16 if cpu.avx512f else 8 if cpu.avx2 else 4)
    assert cpu.registers == (32 if cpu.avx512f else 16)
    assert cpu.l1d_bytes > 0 and cpu.l2_bytes >= cpu.l1d_bytes and cpu.l3_bytes > 0 and cpu.threads >= 1
    assert host_cpu().llc_bytes == cpu.l3_bytes and host_cpu().l2_bytes_per_core == cpu.l2_bytes


def test_haswell_is_avx2_with_16_registers():
    cpu = CpuTarget.from_target(HASWELL)
    assert (cpu.cpu, cpu.arch, cpu.vector_bits, cpu.lanes, cpu.registers) == ("haswell", "x86_64", 256, 8, 16)
    assert cpu.avx2 and cpu.fma and not cpu.avx512f and not cpu.avx512_bf16 and not cpu.amx
    assert (cpu.l1d_bytes, cpu.l2_bytes) == (KNOWN_CPUS["haswell"].l1d, KNOWN_CPUS["haswell"].l2)


@pytest.mark.parametrize("target,l1d,l2,vnni", [(ZNVER4, 32 << 10, 1 << 20, False), (ZNVER5, 48 << 10, 1 << 20, True)])
def test_zen_4_and_5_are_avx512_with_bf16(target, l1d, l2, vnni):
    cpu = CpuTarget.from_target(target)
    assert (cpu.lanes, cpu.registers, cpu.l1d_bytes, cpu.l2_bytes) == (16, 32, l1d, l2)
    assert cpu.avx512f and cpu.avx512bw and cpu.avx512_bf16 and cpu.avx512_vnni and not cpu.amx
    assert cpu.avxvnni == vnni and not cpu.host


def test_sapphire_rapids_has_amx_and_its_own_caches():
    cpu = CpuTarget.from_target(SPR)
    assert (cpu.lanes, cpu.registers) == (16, 32) and cpu.amx and cpu.avx512_bf16 and cpu.avxvnni
    assert (cpu.l2_bytes, cpu.l3_bytes) == (2 << 20, 105 << 20)


def test_an_aarch64_target_has_neon_sve_and_32_registers():
    cpu = CpuTarget.from_target(NEOVERSE_V1 + " -num-cores=8")
    assert (cpu.arch, cpu.lanes, cpu.registers, cpu.fma_units, cpu.threads) == ("aarch64", 4, 32, 4, 8)
    assert cpu.neon and cpu.sve and not cpu.avx2 and not cpu.host


def test_a_dict_its_json_and_a_tvm_target_describe_the_same_cpu():
    import tvm

    spec = {"kind": "llvm", "mcpu": "haswell", "num-cores": 4}
    by_dict, by_json = CpuTarget.from_target(spec), CpuTarget.from_target(json.dumps(spec))
    assert by_dict == by_json == CpuTarget.from_target(tvm.target.Target(spec)) \
        == CpuTarget.from_target("llvm -mcpu=haswell -num-cores=4")
    assert by_dict.threads == 4
    with_avx512 = CpuTarget.from_target({**spec, "mattr": ["+avx512f"]})
    assert with_avx512.avx512f and with_avx512.lanes == 16


@pytest.mark.parametrize("bad", ["llvm -mcpu=nosuchcpu", "llvm mcpu", {"kind": "cuda"}, 42])
def test_a_target_that_is_no_known_cpu_is_an_error(bad):
    with pytest.raises(TargetError):
        CpuTarget.from_target(bad)


def test_using_sets_the_current_target_and_restores_it():
    host = current()
    with using(HASWELL) as cpu:
        assert current() is cpu and vector_lanes() == 8 and vector_registers() == 16
        with using(NEOVERSE_V1):
            assert vector_lanes() == 4
        assert vector_lanes() == 8
    assert current() == host


@pytest.mark.parametrize("target,panel,rows,accumulators,gemv", [(HASWELL, 16, 4, 8, 64), (ZNVER5, 32, 8, 20, 256),
                                                                 (SPR, 32, 8, 20, 256), (NEOVERSE_V1, 8, 8, 20, 64)])
def test_the_gemm_tile_follows_the_target(target, panel, rows, accumulators, gemv):
    with using(target):
        assert (gemm_tile_columns(), gemm_tile_rows(), gemm_accumulators(), gemv_tile_lanes()) == \
            (panel, rows, accumulators, gemv)


def test_avx512_budgets_are_the_numbers_measured_with_32_registers():
    """The register budgets, now counts of the target's registers, are what they were as constants."""
    with using(SPR):
        assert (conv.conv_max_lanes(), conv.conv_lanes()) == (32, (32, 16, 8, 4))
        assert (conv.conv_accumulator_lanes(), conv.conv_broadcast_accumulator_lanes()) == (224, 448)
        assert (conv.conv_window_accumulators(), conv.conv_filter_set_registers(),
                conv.taps_unrolled_registers()) == (20, 28, 36)
    with using(HASWELL):  # AVX2: the same fractions of 16 registers of 8 lanes
        assert (conv.conv_max_lanes(), conv.conv_lanes()) == (16, (16, 8, 4))
        assert (conv.conv_accumulator_lanes(), conv.conv_broadcast_accumulator_lanes()) == (56, 96)
        assert (conv.conv_window_accumulators(), conv.conv_filter_set_registers(),
                conv.taps_unrolled_registers()) == (10, 12, 18)


def test_the_backend_of_a_cli_target_string_compiles_for_that_cpu():
    from souffle_py.backends import backend_for

    backend = backend_for(HASWELL)
    assert backend.cpu.cpu == "haswell" and backend.spec.llc_bytes == KNOWN_CPUS["haswell"].l3
    assert "haswell" in backend.describe()


# --- AVX2 end to end --------------------------------------------------------------------------------------
def _init(name, rng, *shape):
    return numpy_helper.from_array((rng.standard_normal(shape) * 0.2).astype(np.float32), name)


def _conv_relu_gemm() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Flatten", ["r"], ["f"]),
             helper.make_node("Gemm", ["f", "g", "gb"], ["y"], transB=1)]
    inits = [_init("w", rng, 24, 8, 3, 3), _init("b", rng, 24), _init("g", rng, 40, 24 * 6 * 6), _init("gb", rng, 40)]
    graph = helper.make_graph(nodes, "conv_relu_gemm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 6, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 40])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _attention(tokens=12, dim=32) -> onnx.ModelProto:
    rng = np.random.default_rng(1)
    nodes = [helper.make_node("MatMul", ["x", "wq"], ["q"]), helper.make_node("MatMul", ["x", "wk"], ["k"]),
             helper.make_node("MatMul", ["x", "wv"], ["v"]),
             helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["q", "kt"], ["s"]), helper.make_node("Mul", ["s", "scale"], ["ss"]),
             helper.make_node("Softmax", ["ss"], ["p"], axis=-1), helper.make_node("MatMul", ["p", "v"], ["o"]),
             helper.make_node("MatMul", ["o", "wo"], ["y"])]
    inits = [_init(n, rng, dim, dim) for n in ("wq", "wk", "wv", "wo")]
    inits.append(numpy_helper.from_array(np.array(dim ** -0.5, np.float32), "scale"))
    graph = helper.make_graph(nodes, "attention",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, tokens, dim])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, tokens, dim])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.skipif(not HAS_AVX2, reason="runs AVX2 code: needs a CPU with AVX2 and FMA")
@pytest.mark.parametrize("build,shape", [(_conv_relu_gemm, (1, 8, 6, 6)), (_attention, (1, 12, 32))])
def test_a_model_compiled_for_avx2_runs_here_and_matches_onnx_runtime(tmp_path, build, shape):
    model = build()
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    compiled = souffle_py.optimize(str(path), target=HASWELL, cache=False)
    assert "haswell" in compiled.describe()
    assert not any(f.startswith("avx512") for f in compiled.plan.cpu_features)  # no AVX-512 instruction
    scripts = "\n".join(f.script() for f in compiled.scheduled_functions.values())
    assert "T.vectorized(8)" in scripts and "T.vectorized(32)" not in scripts  # AVX2's lanes, not AVX-512's
    feeds = {"x": np.random.default_rng(2).standard_normal(shape).astype(np.float32)}
    ours, reference = compiled.run(feeds), OnnxRuntimeModel(model, threads=1).run(feeds)
    np.testing.assert_allclose(ours["y"], reference["y"], rtol=1e-4, atol=1e-4)


def test_each_measured_threshold_is_in_the_table_with_its_provenance():
    """thresholds.py: every entry preceded by a comment saying what it was measured on; the rules read it."""
    from pathlib import Path

    from souffle_py.schedule import bf16_gemm, padded_write_back, streaming, thresholds
    from souffle_py.schedule.rules import conv_tile, row_chain

    lines = Path(thresholds.__file__).read_text().splitlines()
    for name in thresholds.TABLE:
        at = next(i for i, line in enumerate(lines) if line.startswith(f"{name} ="))
        assert lines[at - 1].startswith("#"), name
    assert streaming.L2_CHUNK_BYTES == bf16_gemm.L2_CHUNK_BYTES == conv_tile.L2_CHUNK_BYTES == thresholds.L2_CHUNK_BYTES
    assert (row_chain.ROW_CHAIN_MIN_BYTES, padded_write_back.MIN_PADDED_BYTES, conv_tile.CHUNK_MIN_WEIGHT_BYTES) == \
        (thresholds.ROW_CHAIN_MIN_BYTES, thresholds.MIN_PADDED_BYTES, thresholds.CHUNK_MIN_WEIGHT_BYTES)


@pytest.mark.parametrize("target,one_vector,two_vectors", [(HASWELL, 7, 4), (SPR, 15, 10), (ZNVER5, 15, 10)])
def test_dot_conv_tiles_leave_a_register_per_pixel_for_its_broadcast(target, one_vector, two_vectors):
    """The vdpbf16ps / vpdpbusd conv tile: pixels x vectors accumulators, a broadcast input per pixel and the
    weight rows within the target's vector registers."""
    from souffle_py.schedule.bf16_conv import tile_pixels

    with using(target):
        assert (tile_pixels(1), tile_pixels(2)) == (one_vector, two_vectors)
        for vectors in (1, 2):
            assert tile_pixels(vectors) * (vectors + 1) + vectors <= vector_registers()
