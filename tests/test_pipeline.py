"""The pass pipeline: specs and presets, per-pass records and logs, the models with every pass on (against
ONNX Runtime, float32 rtol 1e-4 / atol 1e-5) and `souffle analyze --passes`."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from models.registry import build_model
from souffle_py import cli
from souffle_py.baselines import OnnxRuntimeModel
from souffle_py.errors import SouffleError
from souffle_py.frontend import import_onnx
from te_passes.check import run_program
from te_passes.pipeline import PassPipeline


@pytest.mark.parametrize("spec,enabled", [
    (None, ("vertical", "horizontal")), ("all", ("vertical", "horizontal")), ("none", ()), ("V0", ()),
    ("v1", ("horizontal",)), ("V2", ("vertical", "horizontal")), ("horizontal,vertical", ("vertical", "horizontal")),
    (["horizontal"], ("horizontal",)), (" vertical ", ("vertical",))])
def test_specs_and_presets(spec, enabled):
    assert PassPipeline.from_spec(spec).enabled == enabled


def test_switches_and_bad_names():
    pipeline = PassPipeline.from_spec("V2")
    assert pipeline.disable("vertical").enabled == ("horizontal",)
    assert PassPipeline.from_spec("V0").enable("vertical").enabled == ("vertical",)
    assert PassPipeline.from_spec(pipeline) is pipeline
    with pytest.raises(SouffleError, match="unknown pass"):
        PassPipeline.from_spec("vertical,fuse_everything")


def test_records_chain_and_are_logged(caplog):
    program = import_onnx(build_model("bert", tiny=True))
    with caplog.at_level(logging.INFO, logger="te_passes.pipeline"):
        new, records = PassPipeline.from_spec("V2").run(program)
    assert [r.name for r in records] == ["vertical", "horizontal"]
    assert records[0].tes_before == len(program.stages) == 102
    assert records[0].tes_after == records[1].tes_before and records[1].tes_after == len(new.stages) == 40
    assert all(r.line() in caplog.text for r in records)
    unchanged, none = PassPipeline.from_spec("V0").run(program)
    assert unchanged is program and none == []


@pytest.mark.parametrize("name,overrides", [("bert", {"layernorm": "primitive"}), ("bert", {"layernorm": "op"}),
                                            ("lstm", {"spelling": "op"}), ("lstm", {"spelling": "unrolled"})])
def test_models_match_onnx_runtime_with_every_pass(name, overrides):
    proto = build_model(name, tiny=True, **overrides)
    program = import_onnx(proto)
    new, records = PassPipeline.from_spec("all").run(program)
    assert records[-1].tes_after < records[0].tes_before
    feeds = program.random_feeds(seed=5)
    expected = OnnxRuntimeModel(proto).run(feeds)
    for key, value in run_program(new, feeds).items():
        np.testing.assert_allclose(value, expected[key], rtol=1e-4, atol=1e-5)


def test_horizontal_alone_matches_onnx_runtime():  # the paper's V1
    proto = build_model("bert", tiny=True)
    program = import_onnx(proto)
    new, _ = PassPipeline.from_spec("V1").run(program)
    feeds = program.random_feeds(seed=6)
    expected = OnnxRuntimeModel(proto).run(feeds)
    np.testing.assert_allclose(run_program(new, feeds)["output"], expected["output"], rtol=1e-4, atol=1e-5)


def test_cli_analyze_prints_te_counts_per_pass(tmp_path, capsys):
    import onnx

    path = tmp_path / "bert.onnx"
    onnx.save(build_model("bert", tiny=True), str(path))
    assert cli.main(["analyze", str(path), "--passes", "V2"]) == 0
    out = capsys.readouterr().out
    assert "TE transformations (V2: vertical, horizontal)" in out
    lines = {line.split()[0]: line.split() for line in out.splitlines()[-3:-1]}
    assert lines["vertical"][1:3] == ["102", "48"] and lines["horizontal"][1:3] == ["48", "40"]
    assert "102 TEs -> 40 TEs" in out
    assert cli.main(["analyze", str(path), "--passes", "nonsense"]) == 2
