"""The partitioner cuts only before compute-intensive TEs, records why, and follows the resource rules."""

import pytest

import souffle_py
from models.registry import build_model
from souffle_py.frontend import import_onnx
from souffle_py.partition import (A100, H100, CacheResidentPolicy, LaunchConfig, OccupancyPolicy,
                                  max_active_blocks_per_sm, partition, policy_for)
from souffle_py.ir.analysis import analyze


@pytest.fixture(scope="module")
def tiny_bert():
    program = import_onnx(build_model("bert", tiny=True, layers=3))
    return program, analyze(program)


def _check_cuts_at_ci(parts, analysis):
    assert parts.subprograms[0].reason == "program start"
    for sub in parts.subprograms[1:]:
        assert analysis.te_of(sub.ops[0]).klass == "CI"
        assert sub.reason.startswith(f"cut before CI TE {sub.ops[0].name}: ")


def test_every_te_lands_in_exactly_one_subprogram_in_order(tiny_bert):
    program, analysis = tiny_bert
    parts = partition(analysis, program.stages, CacheResidentPolicy(budget_bytes=1 << 16))
    assert [op for sub in parts.subprograms for op in sub.ops] == program.stages


def test_cache_budget_cuts_once_per_layer(tiny_bert):
    """A budget of one layer's weights plus the live intermediates, less than one more weight matrix."""
    program, analysis = tiny_bert
    layer_weights = sum(t.bytes for t in analysis.tensors.values() if t.kind == "param" and t.name.startswith("layer0"))
    budget = layer_weights + analysis.peak.bytes + 64 * 64 * 4 // 2
    parts = partition(analysis, program.stages, CacheResidentPolicy(budget_bytes=budget))
    assert len(parts.subprograms) == 3
    _check_cuts_at_ci(parts, analysis)
    assert all("last-level cache" in s.reason for s in parts.subprograms[1:])
    assert [s.ops[0].name for s in parts.subprograms] == [f"layer{i}_attn_q_matmul" for i in range(3)]


def test_stage_limit_cuts_only_at_ci(tiny_bert):
    program, analysis = tiny_bert
    parts = partition(analysis, program.stages, CacheResidentPolicy(budget_bytes=1 << 30, max_stages=10))
    assert len(parts.subprograms) > 3
    _check_cuts_at_ci(parts, analysis)
    assert any("compile size" in s.reason for s in parts.subprograms[1:])


def test_generous_budget_keeps_one_subprogram(tiny_bert):
    program, analysis = tiny_bert
    parts = partition(analysis, program.stages, CacheResidentPolicy(budget_bytes=1 << 30, max_stages=10**6))
    assert len(parts.subprograms) == 1


@pytest.mark.parametrize("spec,threads,regs,smem,expected", [
    (A100, 256, 32, 0, 8),            # thread-limited: 2048 / 256
    (A100, 1024, 64, 0, 1),           # register-limited: 64 regs * 1024 threads = 65536
    (A100, 128, 128, 0, 4),           # 128 regs * 128 threads = 16384 per block
    (A100, 128, 32, 100 * 1024, 1),   # shared-memory-limited: 164 KiB / 100 KiB
    (H100, 64, 32, 0, 32),            # block-limited: at most 32 resident blocks
    (A100, 2048, 32, 0, 0),           # more than 1024 threads cannot launch
])
def test_occupancy_formula(spec, threads, regs, smem, expected):
    assert max_active_blocks_per_sm(spec, threads, regs, smem) == expected


def test_occupancy_policy_cuts_when_the_grid_cannot_be_resident(tiny_bert):
    program, analysis = tiny_bert
    launches = {name: LaunchConfig(blocks=500, threads_per_block=256) for name in analysis.tes}
    policy = OccupancyPolicy(A100, launch_of=lambda info: launches[info.name])
    parts = partition(analysis, program.stages, policy)
    assert len(parts.subprograms) == 1  # 500 blocks <= 108 SMs * 8 blocks: one cooperative launch
    policy = OccupancyPolicy(A100, launch_of=lambda info: LaunchConfig(
        blocks=1000 if info.klass == "CI" else 10, threads_per_block=256))
    parts = partition(analysis, program.stages, policy)
    _check_cuts_at_ci(parts, analysis)
    assert len(parts.subprograms) == sum(1 for t in analysis.tes.values() if t.klass == "CI")
    assert "occupancy: 1000 blocks > 108 SMs x 8 resident blocks per SM on A100" in parts.subprograms[1].reason


def test_policy_for_target():
    assert isinstance(policy_for("llvm"), CacheResidentPolicy)
    assert isinstance(policy_for("cuda"), OccupancyPolicy)


def test_optimize_merges_and_describes_cut_reasons():
    model = souffle_py.optimize(build_model("bert", tiny=True, layers=3))
    unfused = souffle_py.optimize(build_model("bert", tiny=True, layers=3), merge=False)
    assert model.num_kernels < unfused.num_kernels
    text = model.describe()
    assert "program start" in text and ("cut before CI TE" in text or model.num_kernels == 1)
