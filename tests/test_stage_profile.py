"""The stage profile (souffle_py/stage_profile.py): a merged CPU kernel timed stage by stage, on tiny models."""

from __future__ import annotations

import numpy as np
import pytest
import tvm

import souffle_py
from models.registry import build_model
from souffle_py.stage_profile import StageProfileError, instrumented, stage_lines

RULES = {"gemm", "conv", "reduction", "pad", "injective"}


@pytest.fixture(scope="module", params=["bert", "resnext"])
def compiled(request):
    return souffle_py.optimize(build_model(request.param, tiny=True))


def test_every_stage_of_every_kernel_is_timed_once_and_names_its_onnx_nodes(compiled):
    rows = compiled.profile(repeat=3, stages=True)
    assert len(rows) == len(compiled.plan.calls)
    for row in rows:
        call = next(c for c in compiled.plan.calls if c.name == row["kernel"])
        timed = [te for group in row["stages"] for te in group["stages"]]
        assert sorted(timed) == sorted(call.stages)  # each TE in exactly one group, none lost
        for group in row["stages"]:
            assert group["median_ms"] >= 0
            assert group["nodes"] and "?" not in group["nodes"]
            assert set(group["nodes"]) <= set(call.nodes)
            assert set(group["rule"].split("+")) <= RULES
        # no timing comparison here (a shared 2-core machine's noise made the sum of stage medians exceed the
        # call's median); that the stamps sit inside the call is checked structurally below
        assert np.isfinite(row["stages_ms"]) and row["stages_ms"] == pytest.approx(
            sum(g["median_ms"] for g in row["stages"]))
        assert row["instrumented_ms"] > 0 and row["paired_ms"] > 0
    assert sum(g["flops"] for r in rows for g in r["stages"]) == sum(c.flops for c in compiled.plan.calls)


def test_the_profile_table_lists_the_stages_under_their_kernel(compiled):
    rows = compiled.profile(repeat=2, stages=True)
    text = compiled.format_profile(rows, peak_gflops=100.0, top_stages=3)
    assert "stage groups, sum" in text and "<-" in text
    assert len(stage_lines(rows[0], 100.0, top=2)) == min(2, len(rows[0]["stages"])) + 1


def test_the_instrumented_kernel_computes_what_the_kernel_computes(compiled):
    """The clock stores change nothing else: same outputs, and one stamp more than loop nests."""
    call = compiled.plan.calls[0]
    func, nests = instrumented(compiled.scheduled_functions[call.function], "probe")
    library = tvm.compile(tvm.IRModule({"probe": func}), target=compiled.target)
    feeds = compiled.random_feeds(seed=1)
    with compiled.workspace() as ws:
        compiled._load(ws, feeds)
        for func, call_args in ws.calls:
            func(*call_args)
        _, args = ws.calls[0]
        outputs = [compiled.plan.buffer(a) for a in call.args
                   if compiled.plan.buffer(a).role in ("output", "intermediate")]
        expected = {spec.name: ws.buffers[spec.name].numpy() for spec in outputs}
        for spec in outputs:  # poison what the kernel writes, then let the instrumented copy write it again
            ws.buffers[spec.name].copyfrom(np.full(spec.shape, np.nan, spec.dtype))
        clock = tvm.runtime.tensor(np.zeros(len(nests) + 1, "int64"), compiled.device)  # every stamp stored
        library["probe"](*args, clock)
        for spec in outputs:
            np.testing.assert_array_equal(ws.buffers[spec.name].numpy(), expected[spec.name])
    assert np.all(clock.numpy() > 0) and np.all(np.diff(clock.numpy()) >= 0)


def test_a_loaded_model_cannot_be_profiled_by_stage(compiled, tmp_path):
    compiled.export(tmp_path / "model.tar")
    loaded = souffle_py.load(tmp_path / "model.tar")
    with pytest.raises(StageProfileError, match="compiled in this process"):
        loaded.profile(repeat=1, stages=True)
    assert loaded.profile(repeat=1)  # the kernel-level profile still works


def test_an_epilogue_stored_by_a_gemm_write_back_is_timed_in_the_gemm_nest():
    """BERT's GELU runs in the FFN's first GEMM's write-back (block "s{i}_local" storing stage i+1): it is
    timed there, with that GEMM's node, not with the second GEMM that reads it."""
    model = souffle_py.optimize(build_model("bert", tiny=True))
    groups = [g for row in model.profile(repeat=2, stages=True) for g in row["stages"]]
    gelu = [g for g in groups if any(n.endswith("gelu_mul") for n in g["nodes"])]
    assert gelu
    for group in gelu:
        assert any(n.endswith("fc1_matmul") for n in group["nodes"]), group["nodes"]
        assert not any(n.endswith("fc2_matmul") for n in group["nodes"]), group["nodes"]
