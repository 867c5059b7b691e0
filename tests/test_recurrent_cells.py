"""ONNX's LSTM, GRU and RNN in every form the specification allows, checked against ONNX Runtime
(frontend/ops/rnn.py, frontend/ops/cells.py). Tiny sizes: each case compiles in about a second."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import souffle_py
from souffle_py.baselines import OnnxRuntimeModel
from souffle_py.errors import UnsupportedError

GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
STEPS, BATCH, INPUT, HIDDEN = 5, 3, 4, 8


def recurrent_model(op, direction="forward", layout=0, lens=None, initial=False, peepholes=False,
                     runtime_weights=False, runtime_lens=False, bias=True, opset=22, **attrs):
    """One recurrent node with all its outputs; lens (one per batch row) given as sequence_lens."""
    rng = np.random.default_rng(7)
    dirs = 2 if direction == "bidirectional" else 1
    width = GATES[op] * HIDDEN
    x_shape = [STEPS, BATCH, INPUT] if layout == 0 else [BATCH, STEPS, INPUT]
    state_shape = [dirs, BATCH, HIDDEN] if layout == 0 else [BATCH, dirs, HIDDEN]
    values = {"W": rng.standard_normal((dirs, width, INPUT)) * 0.5, "R": rng.standard_normal((dirs, width, HIDDEN)) * 0.4}
    if bias:
        values["B"] = rng.standard_normal((dirs, 2 * width)) * 0.3
    if peepholes:
        values["P"] = rng.standard_normal((dirs, 3 * HIDDEN)) * 0.3
    values = {k: v.astype(np.float32) for k, v in values.items()}
    inputs = [helper.make_tensor_value_info("X", TensorProto.FLOAT, x_shape)]
    initializers = []
    for name, value in values.items():
        if runtime_weights:
            inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, list(value.shape)))
        else:
            initializers.append(onnx.numpy_helper.from_array(value, name))
    names = ["X", "W", "R", "B" if bias else ""]
    if lens is not None:
        if runtime_lens:
            inputs.append(helper.make_tensor_value_info("L", TensorProto.INT32, [BATCH]))
        else:
            initializers.append(onnx.numpy_helper.from_array(np.array(lens, np.int32), "L"))
    names.append("L" if lens is not None else "")
    if initial:
        names.append("h0")
        inputs.append(helper.make_tensor_value_info("h0", TensorProto.FLOAT, state_shape))
        if op == "LSTM":
            names.append("c0")
            inputs.append(helper.make_tensor_value_info("c0", TensorProto.FLOAT, state_shape))
    if peepholes:
        names += [""] * (7 - len(names)) + ["P"]
    while names and names[-1] == "":
        names.pop()
    outputs = ["Y", "Y_h", "Y_c"][:3 if op == "LSTM" else 2]
    y_shape = [STEPS, dirs, BATCH, HIDDEN] if layout == 0 else [BATCH, STEPS, dirs, HIDDEN]
    if opset >= 14:
        attrs["layout"] = layout
    node = helper.make_node(op, names, outputs, name="cell", hidden_size=HIDDEN, direction=direction, **attrs)
    graph = helper.make_graph([node], op.lower(), inputs,
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, y_shape if o == "Y" else state_shape)
                               for o in outputs], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model, values


def check(model, values, runtime_weights=False, lens=None, runtime_lens=False):
    compiled = souffle_py.optimize(model, quiet=True)
    feeds = compiled.random_feeds(seed=3)
    if runtime_weights:
        feeds.update(values)
    if runtime_lens:
        feeds["L"] = np.array(lens, np.int32)
    expected = reference(model, feeds)
    got = compiled.run(feeds)
    assert set(got) == set(expected)
    for name, value in got.items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-4, atol=1e-5, err_msg=name)
    return compiled


def reference(model, feeds):
    """ONNX Runtime's outputs; it refuses layout 1, so a batch-major node runs as its layout-0 twin with its
    inputs and outputs transposed."""
    node = model.graph.node[0]
    layout = next((a.i for a in node.attribute if a.name == "layout"), 0)
    if not layout:
        return OnnxRuntimeModel(model, threads=1).run(feeds)
    twin = onnx.ModelProto()
    twin.CopyFrom(model)
    for attribute in twin.graph.node[0].attribute:
        if attribute.name == "layout":
            attribute.i = 0
    batch_major = {"X": (1, 0, 2), "h0": (1, 0, 2), "c0": (1, 0, 2)}
    for value in [*twin.graph.input, *twin.graph.output]:
        dims = value.type.tensor_type.shape.dim
        order = {"Y": (1, 2, 0, 3)}.get(value.name, batch_major.get(value.name) or
                                        ((1, 0, 2) if value.name in ("Y_h", "Y_c") else None))
        if order:
            sizes = [dims[i].dim_value for i in order]
            for dim, size in zip(dims, sizes):
                dim.dim_value = size
    twin_feeds = {k: v.transpose(batch_major[k]) if k in batch_major else v for k, v in feeds.items()}
    out = OnnxRuntimeModel(twin, threads=1).run(twin_feeds)
    back = {"Y": (2, 0, 1, 3), "Y_h": (1, 0, 2), "Y_c": (1, 0, 2)}
    return {k: np.ascontiguousarray(v.transpose(back[k])) for k, v in out.items()}


FORMS = [
    dict(direction="forward"), dict(direction="reverse"), dict(direction="bidirectional"),
    dict(direction="bidirectional", layout=1, initial=True),
    dict(direction="forward", lens=[5, 2, 0], initial=True),
    dict(direction="bidirectional", lens=[3, 5, 1]),
    dict(direction="reverse", lens=[4, 1, 5], layout=1),
    dict(direction="forward", clip=0.7, bias=False),
]


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("form", FORMS, ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()))
def test_every_form_matches_onnx_runtime(op, form):
    model, values = recurrent_model(op, **form)
    check(model, values)


@pytest.mark.parametrize("lbr", [0, 1])
@pytest.mark.parametrize("direction", ["forward", "bidirectional"])
def test_gru_both_reset_placements(lbr, direction):
    model, values = recurrent_model("GRU", direction=direction, linear_before_reset=lbr, initial=True, lens=[5, 3, 4])
    check(model, values)


def test_lstm_peepholes_input_forget_and_clip():
    model, values = recurrent_model("LSTM", direction="bidirectional", peepholes=True, input_forget=1, clip=1.5,
                                    initial=True)
    check(model, values)


@pytest.mark.parametrize("op,activations,alpha,beta", [
    ("RNN", ["Relu"], None, None),
    ("RNN", ["LeakyRelu", "HardSigmoid"], [0.1, 0.3], [0.4]),  # bidirectional: one per direction
    ("GRU", ["HardSigmoid", "Softsign"], [0.3], [0.6]),
    ("LSTM", ["Sigmoid", "Tanh", "Softsign"], None, None),
    ("RNN", ["Elu"], [0.5], None),
    ("RNN", ["Affine"], [0.5], [0.1]),
    ("RNN", ["ThresholdedRelu"], [0.2], None),
    ("RNN", ["ScaledTanh"], [1.5], [0.5]),
    ("RNN", ["Softplus"], None, None),
])
def test_activation_functions_with_alpha_and_beta(op, activations, alpha, beta):
    attrs = {"activations": activations}
    if alpha:
        attrs["activation_alpha"] = alpha
    if beta:
        attrs["activation_beta"] = beta
    direction = "bidirectional" if len(activations) == 2 and op == "RNN" else "forward"
    model, values = recurrent_model(op, direction=direction, **attrs)
    try:
        OnnxRuntimeModel(model, threads=1)
    except Exception as exc:  # ONNX Runtime's CPU kernels implement only some functions for some cells
        pytest.skip(f"ONNX Runtime cannot run it: {str(exc)[:80]}")
    check(model, values)


def test_weights_and_sequence_lens_given_at_run_time():
    lens = [2, 5, 3]
    model, values = recurrent_model("GRU", direction="bidirectional", lens=lens, runtime_weights=True,
                                    runtime_lens=True, linear_before_reset=1)
    check(model, values, runtime_weights=True, lens=lens, runtime_lens=True)


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_opset_7_form(op):
    model, values = recurrent_model(op, direction="bidirectional", opset=7, initial=True)
    check(model, values)


def test_what_is_not_supported_names_node_and_value():
    model, _ = recurrent_model("RNN", activations=["Gelu"])
    with pytest.raises(UnsupportedError, match=r"cell.*Gelu"):
        souffle_py.optimize(model, quiet=True)
    model, _ = recurrent_model("LSTM", direction="bidirectional", activations=["Sigmoid", "Tanh", "Tanh"])
    with pytest.raises(UnsupportedError, match="expected 3 per direction"):
        souffle_py.optimize(model, quiet=True)
