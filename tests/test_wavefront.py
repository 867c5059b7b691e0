"""The layer x time wavefront of stacked recurrences (te_passes/wavefront.py): which recurrences form a
chain, that the rewritten program computes bit-identical outputs, and the barriers it saves on the GPU."""

import logging

import numpy as np
import pytest

import souffle_py
from models.common import GraphBuilder
from models.lstm import Config, _op_layer
from models.registry import build_model
from souffle_py.baselines import OnnxRuntimeModel
from souffle_py.frontend import import_onnx
from te_passes.check import assert_same_outputs, run_program
from souffle_py.passes import transformed
from souffle_py.ir.marks import member_of, recurrences
from te_passes.wavefront import chains, wavefront


def _program(proto, passes="all"):
    return transformed(import_onnx(proto), passes)[0]


@pytest.mark.parametrize("passes", ["all", "none"])
def test_stacked_lstm_layers_form_one_chain_skewed_by_layer(passes):
    program = _program(build_model("lstm", tiny=True, layers=3), passes)
    (chain,) = chains(program)
    assert chain.recurrences == ("layer0/lstm", "layer1/lstm", "layer2/lstm") and chain.steps == 5
    skews = {op.name: s for op, s in chain.skew.items()}
    assert skews["layer0_lstm_h"] == 0 and skews["layer2_lstm_h"] == 2
    assert skews["layer1_lstm_x_proj"] == 1  # the bridge: layer 1's input projection of layer 0's output
    assert "layer0_lstm_x_proj" not in skews  # reads the model input: stays one GEMM over all steps


@pytest.mark.parametrize("passes", ["all", "none"])
def test_wavefront_program_is_bit_identical(passes):
    program = _program(build_model("lstm", tiny=True, layers=3), passes)
    after = wavefront(program)
    (name,) = recurrences(after.stages)
    members = recurrences(after.stages)[name]
    assert all(int(op.output(0).shape[0]) == 5 + 3 - 1 for op in members)
    assert {op.name for op in members} >= {"layer1_lstm_x_proj", "layer2_lstm_x_proj"}
    assert_same_outputs(program, after, rtol=0, atol=0)


def test_a_single_recurrence_is_left_alone():
    program = _program(build_model("lstm", tiny=True, layers=1))
    assert chains(program) == [] and wavefront(program) is program


def _reversed_stack() -> "onnx.ModelProto":
    """Two LSTM layers, the second reading the first's outputs in reverse time order: step t of layer 1
    needs step T - 1 - t of layer 0, so no skew lines the steps up."""
    c = Config(layers=2, hidden=8, input=8, steps=4)
    b = GraphBuilder("reversed", seed=0, opset=17)
    x = b.input("x", [c.steps, c.batch, c.input])
    y0 = _op_layer(b, x, c, 0, c.input, None)
    flipped = b.node("Slice", [y0, b.const("starts", np.array([-1], np.int64)),
                               b.const("ends", np.array([-(2 ** 62)], np.int64)),
                               b.const("axes", np.array([0], np.int64)), b.const("steps", np.array([-1], np.int64))],
                     name="flip")
    _op_layer(b, flipped, c, 1, c.hidden, "output")
    b.output("output", [c.steps, c.batch, c.hidden])
    return b.model()


def test_layers_that_do_not_line_up_keep_their_loops_and_say_why(caplog):
    proto = _reversed_stack()
    program = _program(proto)
    with caplog.at_level(logging.INFO, logger="te_passes.wavefront"):
        after = wavefront(program)
    assert after is program and "keeps one time loop per layer" in caplog.text
    assert {member_of(op) for op in after.stages} - {None} == {"layer0/lstm", "layer1/lstm"}
    feeds = program.random_feeds()
    expected = OnnxRuntimeModel(proto).run(feeds)["output"]
    np.testing.assert_allclose(run_program(after, feeds)["output"], expected, rtol=1e-4, atol=1e-5)


def test_cuda_lstm_needs_two_barriers_per_wavefront_step():
    """3 layers x 4 steps: 6 wavefront steps, each one barrier between the GEMVs and the cell updates of
    all layers and one at its end, plus one after the input projection and one before the output copy
    (without the wavefront: 2 per layer and step, 3 x 4 x 2 + 2 = 26)."""
    model = souffle_py.optimize(build_model("lstm", tiny=True, layers=3, steps=4), target="h100")
    (call,) = model.plan.calls
    (launch,) = call.launches
    assert launch.cooperative and launch.grid_syncs == 2 * (4 + 3 - 1) + 2
    assert "time loops: 1 (recurrences; inside the kernel, a grid barrier per step)" in model.describe()


def test_the_unfused_reference_keeps_one_time_loop_per_layer():
    """The wavefront is a rewrite for the merged kernels (Backend.restructure), not part of the unfused
    reference or the V0-V2 ablation rows."""
    model = souffle_py.optimize(build_model("lstm", tiny=True, layers=3, steps=4), target="h100", merge=False)
    names = [call.name for call in model.plan.calls]
    assert ["layer0/lstm", "layer1/lstm", "layer2/lstm"] == [n for n in names if n.endswith("/lstm")]
