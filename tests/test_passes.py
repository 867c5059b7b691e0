"""The pass manager (souffle_py/passes): selections and presets, records and logs, the failure policy,
facts, the numeric check, every CPU pass switched off alone on tiny models (against ONNX Runtime), and the
CLI's `souffle passes` and `souffle analyze --passes`."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import souffle_py
from models.registry import build_model
from souffle_py import cli
from souffle_py.baselines import OnnxRuntimeModel
from souffle_py.errors import InputError, SouffleError
from souffle_py.failures import RuleFailedError
from souffle_py.frontend import import_onnx
from souffle_py.passes import Pass, PassContext, passes_for, run_passes, select, transformed
from souffle_py.passes.transformations import TRANSFORMATIONS
from te_passes.check import run_program

CPU = passes_for("cpu")
LOWERING = {p.name for p in CPU if p.group in ("layout", "precision")}


@pytest.mark.parametrize("spec,added", [
    (None, {"vertical", "horizontal", "fold_channel_scales", "group_gate_projections", "fold_conv_branches"}),
    ("all", {"vertical", "horizontal", "fold_channel_scales", "group_gate_projections", "fold_conv_branches"}),
    ("V2", {"vertical", "horizontal", "fold_channel_scales", "group_gate_projections", "fold_conv_branches"}),
    ("none", set()), ("V0", set()), ("v1", {"horizontal", "group_gate_projections", "fold_conv_branches"}),
    ("horizontal,vertical", {"vertical", "horizontal"}), (["horizontal"], {"horizontal"}),
    (" vertical ", {"vertical"}),
    ("V1,vertical", {"horizontal", "group_gate_projections", "vertical", "fold_conv_branches"})])
def test_presets_and_names_add_to_the_lowering(spec, added):
    assert select(spec, CPU) == frozenset(LOWERING | added)


def test_switching_off_by_name_or_group_and_bad_names():
    assert select("-pack_weights", CPU) == frozenset(p.name for p in CPU) - {"pack_weights"}
    assert select("V0,-layout", CPU) == frozenset(p.name for p in CPU if p.group == "precision")
    assert "wavefront" in select("all", passes_for("cuda")) and "wavefront" not in select("-restructure",
                                                                                          passes_for("cuda"))
    with pytest.raises(InputError, match="unknown pass 'fuse_everything'.*pack_weights"):
        select("vertical,fuse_everything", CPU)
    with pytest.raises(InputError, match="unknown pass"):
        souffle_py.optimize(build_model("mmoe", tiny=True), passes="-nonsense")


def test_records_chain_and_are_logged(caplog):
    program = import_onnx(build_model("bert", tiny=True))
    with caplog.at_level(logging.INFO, logger="souffle_py.passes"):
        new, records = transformed(program, "V2")
    assert [r.name for r in records] == ["vertical", "horizontal"]
    assert records[0].tes_before == len(program.stages) == 102
    assert records[0].tes_after == records[1].tes_before and records[1].tes_after == len(new.stages) == 40
    assert all(r.line() in caplog.text for r in records)
    unchanged, none = transformed(program, "V0")
    assert unchanged is program and none == []


def _broken(program, context):
    raise ValueError("a bug in a pass")


def _provides(program, context):
    return program


def test_a_failing_pass_is_named_and_what_needs_it_is_skipped(monkeypatch, caplog):
    program = import_onnx(build_model("mmoe", tiny=True))
    steps = (Pass("broken", "layout", _broken, provides=("fact:a",)), Pass("reader", "layout", _provides,
                                                                        requires=("fact:a",)))
    with pytest.raises(RuleFailedError, match="the broken pass failed on the program"):  # strict in tests
        run_passes(program, steps, PassContext())
    monkeypatch.setenv("SOUFFLE_STRICT", "0")
    with caplog.at_level(logging.WARNING, logger="souffle_py.rules"):
        result, records = run_passes(program, steps, PassContext())
    assert "the broken pass failed on the program (ValueError: a bug in a pass)" in caplog.text
    assert result is program and "skipped (ValueError" in records[0].summary
    assert records[1].summary == "skipped: needs fact:a, which no earlier pass provided"


def _wrong(program, context):
    """A 'pass' that changes the result: the program of another model with the same inputs."""
    return import_onnx(build_model("mmoe", tiny=True, experts=4))


def test_the_numeric_check_catches_a_pass_that_changes_results(monkeypatch):
    program = import_onnx(build_model("mmoe", tiny=True))
    monkeypatch.setenv("SOUFFLE_STRICT", "0")
    result, records = run_passes(program, (Pass("wrong", "layout", _wrong),), PassContext(check="numeric"))
    assert result is program and "differs from its input program's" in records[0].summary
    checked, _ = run_passes(program, TRANSFORMATIONS, PassContext(check="numeric"))
    assert len(checked.stages) < len(program.stages)


def test_onnx_level_folds_are_passes_switched_off_by_name(caplog):
    """fold_conv_branches rewrites the ONNX model before lowering: logged in nodes, checked numerically
    under ONNX Runtime, and off by name the model still matches (its branches then run as convs)."""
    from souffle_py.frontend.loader import load_model
    from tests.test_conv_branches import REPVGG, _model

    model, feeds = _model(REPVGG)
    proto = load_model(model)
    with caplog.at_level(logging.INFO, logger="souffle_py.passes"):
        folded, records = run_passes(proto, CPU, PassContext(check="numeric"), select("all", CPU), level="onnx")
    assert [r.name for r in records] == ["fold_conv_branches"] and records[0].level == "onnx"
    assert records[0].tes_before > records[0].tes_after == len(folded.graph.node)
    assert " nodes in " in caplog.text
    expected = OnnxRuntimeModel(model).run(feeds)
    for spec in ("all", "-fold_conv_branches"):
        got = souffle_py.optimize(model, passes=spec, quiet=True, cache=False).run(feeds)
        np.testing.assert_allclose(got["output_0"] if "output_0" in got else next(iter(got.values())),
                                   next(iter(expected.values())), rtol=1e-4, atol=1e-4, err_msg=spec)


def test_subnormal_parameters_are_flushed_by_a_cpu_pass():
    from te_passes.subnormals import flush_subnormal_params

    program = import_onnx(build_model("mmoe", tiny=True))
    name = next(iter(program.params))
    params = dict(program.params)
    params[name] = params[name].copy()
    params[name].flat[:3] = [1e-40, -1e-39, 2.0]
    flushed, log = flush_subnormal_params(program.replace(params=params))
    assert list(flushed.params[name].flat[:3]) == [0.0, 0.0, 2.0] and name in log.summary()
    same, log = flush_subnormal_params(flushed)
    assert same is flushed and log.summary() == "no subnormal parameter"


def _reversed_rows(reverse: bool):
    """y = relu(x) with its columns reversed (Slice with step -1), or not."""
    from onnx import helper, numpy_helper

    from models.common import IR_VERSION

    nodes = [helper.make_node("Relu", ["x"], ["r"])]
    inits = []
    if reverse:
        inits = [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in
                 (("starts", [-1]), ("ends", [-(2 ** 62)]), ("axes", [1]), ("steps", [-1]))]
        nodes.append(helper.make_node("Slice", ["r", "starts", "ends", "axes", "steps"], ["y"]))
    else:
        nodes.append(helper.make_node("Identity", ["r"], ["y"]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", 1, [4, 6])],
                              [helper.make_tensor_value_info("y", 1, [4, 6])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=IR_VERSION)


def test_the_isl_check_catches_a_pass_that_reads_other_elements(monkeypatch):
    """A 'pass' that drops the reversal reads x[i, j] where y[i, j] depends on x[i, 5 - j]: the footprints
    differ, whatever the values; the CPU passes on tiny models keep every footprint."""
    program = import_onnx(_reversed_rows(True))
    wrong = Pass("wrong", "layout", lambda p, c: import_onnx(_reversed_rows(False)))
    monkeypatch.setenv("SOUFFLE_STRICT", "0")
    result, records = run_passes(program, (wrong,), PassContext(check="isl"))
    assert result is program and "input elements its outputs depend on changed" in records[0].summary
    assert "y <- x" in records[0].summary
    monkeypatch.setenv("SOUFFLE_STRICT", "1")
    from souffle_py.backends import backend_for

    for name in ("bert", "efficientnet", "lstm"):
        _, records = run_passes(import_onnx(build_model(name, tiny=True)), CPU,
                                PassContext(backend_for("llvm"), check="isl"), select("all", CPU))
        assert any(r.summary != "unchanged" for r in records)
    with pytest.raises(InputError, match="unknown proof.*isl, numeric"):
        PassContext(check="isl,proof")


def _applied(proto) -> list[str]:
    """The CPU passes that change this model's program when every pass runs."""
    from souffle_py.backends import backend_for

    _, records = run_passes(import_onnx(proto), CPU, PassContext(backend_for("llvm")), select("all", CPU))
    return [r.name for r in records if r.summary not in ("unchanged",)]


OFF_ALONE = ("bert", "lstm", "efficientnet", "resnext")


@pytest.mark.parametrize("name", OFF_ALONE)
def test_each_pass_switched_off_alone_still_matches_onnx_runtime(name):
    """Every pass that applies to the model (and to none of the models before it), off alone: the compiled
    model still matches ONNX Runtime (no pass relies on another's rewrite without saying so, and no
    schedule on a pass's layout)."""
    proto = build_model(name, tiny=True)
    earlier = {p for other in OFF_ALONE[:OFF_ALONE.index(name)] for p in _applied(build_model(other, tiny=True))}
    applied = [p for p in _applied(proto) if p not in earlier]
    assert applied, f"no pass applies to {name} alone"
    feeds = import_onnx(proto).random_feeds(seed=3)
    expected = OnnxRuntimeModel(proto).run(feeds)
    for off in applied:
        got = souffle_py.optimize(proto, passes=f"-{off}", quiet=True).run(feeds)
        for key, value in got.items():
            np.testing.assert_allclose(value, expected[key], rtol=1e-4, atol=1e-4, err_msg=f"{name} -{off}")


@pytest.mark.parametrize("name,overrides", [("bert", {"layernorm": "primitive"}), ("bert", {"layernorm": "op"}),
                                            ("lstm", {"spelling": "op"}), ("lstm", {"spelling": "unrolled"})])
def test_models_match_onnx_runtime_with_every_transformation(name, overrides):
    proto = build_model(name, tiny=True, **overrides)
    program = import_onnx(proto)
    new, records = transformed(program, "all")
    assert records[-1].tes_after < records[0].tes_before
    feeds = program.random_feeds(seed=5)
    expected = OnnxRuntimeModel(proto).run(feeds)
    for key, value in run_program(new, feeds).items():
        np.testing.assert_allclose(value, expected[key], rtol=1e-4, atol=1e-5)


def test_horizontal_alone_matches_onnx_runtime():  # the paper's V1
    proto = build_model("bert", tiny=True)
    program = import_onnx(proto)
    new, _ = transformed(program, "V1")
    feeds = program.random_feeds(seed=6)
    expected = OnnxRuntimeModel(proto).run(feeds)
    np.testing.assert_allclose(run_program(new, feeds)["output"], expected["output"], rtol=1e-4, atol=1e-5)


def test_cli_lists_the_passes(capsys):
    assert cli.main(["passes", "--passes", "V0"]) == 0
    lines = {line.split()[1]: line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]}
    assert list(lines) == [p.name for p in CPU]
    assert lines["pack_weights"] == "yes" and lines["vertical"] == "-"
    assert cli.main(["passes", "--target", "h100"]) == 0
    assert "wavefront" in capsys.readouterr().out


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
