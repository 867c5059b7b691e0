"""Bad input gets a clear SouffleError naming the node or input — never a TVM stack trace."""

import numpy as np
import onnx
import pytest
from onnx import helper

import souffle_py
from models.common import IR_VERSION
from onnx_cases import assert_matches_ort, single_node_model
from souffle_py.errors import InputError, ModelLoadError, ShapeError, UnsupportedError


def _model(nodes, inputs, outputs, inits=(), opset=17):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=IR_VERSION)


def test_unsupported_op_type_names_node_and_op():
    model = single_node_model("NonZero", {"x": np.zeros((2, 5), np.float32)})
    with pytest.raises(UnsupportedError, match=r"node 'nonzero_node' \(NonZero\): this operator type is not supported"):
        souffle_py.optimize(model)


@pytest.mark.parametrize("attrs,what", [({"direction": "sideways"}, "direction 'sideways'"),
                                        ({"activations": ["Sigmoid", "Swish", "Tanh"]}, "activation function 'Swish'"),
                                        ({"activations": ["Sigmoid", "Tanh"]}, "expected 3 per direction"),
                                        ({"layout": 2}, "layout=2")])
def test_unsupported_attribute_names_node_and_attribute(attrs, what):
    consts = {"W": np.zeros((1, 8, 3), np.float32), "R": np.zeros((1, 8, 2), np.float32)}
    x = np.zeros((4, 1, 3), np.float32) if attrs.get("layout", 0) == 0 else np.zeros((1, 4, 3), np.float32)
    model = single_node_model("LSTM", {"X": x}, outputs=1, consts=consts, hidden_size=2, **attrs)
    with pytest.raises(UnsupportedError, match=rf"node 'lstm_node' \(LSTM\): .*{what}"):
        souffle_py.optimize(model)


def test_data_dependent_shape_is_rejected_by_name():
    model = single_node_model("Reshape", {"x": np.zeros((2, 3), np.float32), "s": np.array([3, 2], np.int64)})
    with pytest.raises(UnsupportedError, match=r"reshape_node.*input 1 's'.*compile-time constant"):
        souffle_py.optimize(model)


def test_other_domain_is_rejected():
    node = helper.make_node("Gelu", ["x"], ["y"], name="g0", domain="com.microsoft")
    model = _model([node], [helper.make_tensor_value_info("x", 1, [2])], [helper.make_tensor_value_info("y", 1, [2])])
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    with pytest.raises(UnsupportedError, match="'g0' \\(Gelu\\): operators of domain 'com.microsoft'"):
        souffle_py.optimize(model)


def _symbolic_model():
    node = helper.make_node("Relu", ["x"], ["y"], name="relu")
    return _model([node], [helper.make_tensor_value_info("x", 1, ["batch", 3])],
                  [helper.make_tensor_value_info("y", 1, ["batch", 3])])


def test_symbolic_dimension_asks_for_concrete_shapes():
    with pytest.raises(ShapeError, match=r"input 'x' has symbolic dimension 'batch' at axis 0.*input_shapes"):
        souffle_py.optimize(_symbolic_model())


def test_input_shapes_make_a_symbolic_model_compile():
    x = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    model = _symbolic_model()
    compiled = souffle_py.optimize(model, input_shapes={"x": (4, 3)})
    np.testing.assert_allclose(compiled.run({"x": x})["y"], np.maximum(x, 0))


@pytest.mark.parametrize("shapes,match", [({"z": (1, 3)}, "not inputs of the model"),
                                          ({"x": (4, 3, 1)}, "rank 3 but the model declares rank 2"),
                                          ({"x": (4, 5)}, "gives 5 at axis 1, but the model fixes it to 3"),
                                          ({"x": (0, 3)}, "positive integers")])
def test_bad_input_shapes(shapes, match):
    with pytest.raises(ShapeError, match=match):
        souffle_py.optimize(_symbolic_model(), input_shapes=shapes)


@pytest.fixture(scope="module")
def relu_model():
    return souffle_py.optimize(single_node_model("Relu", {"x": np.zeros((2, 3), np.float32)}))


@pytest.mark.parametrize("feeds,match", [
    ({}, r"missing input\(s\) \['x'\].*'x' \[2, 3\] float32"),
    ({"x": np.zeros((2, 3), np.float32), "extra": np.zeros(1)}, r"unexpected input\(s\) \['extra'\]"),
    ({"x": np.zeros((3, 2), np.float32)}, r"input 'x' has shape \[3, 2\], expected \[2, 3\]"),
    ({"x": np.zeros((2, 3), np.float64)}, "input 'x' has dtype float64, expected float32"),
    ({"x": [[0.0] * 3] * 2}, "input 'x' must be a numpy array"),
])
def test_run_rejects_bad_feeds(relu_model, feeds, match):
    with pytest.raises(InputError, match=match):
        relu_model.run(feeds)


def test_file_that_is_not_onnx(tmp_path):
    path = tmp_path / "model.onnx"
    path.write_bytes(b"this is not a protobuf \x00\xff\x10")
    with pytest.raises(ModelLoadError, match="not a valid ONNX model"):
        souffle_py.optimize(str(path))


def test_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file"):
        souffle_py.optimize(str(tmp_path / "absent.onnx"))


def test_model_failing_the_checker():
    node = helper.make_node("Relu", ["x", "x"], ["y"], name="bad_relu")  # Relu takes one input
    model = _model([node], [helper.make_tensor_value_info("x", 1, [2])], [helper.make_tensor_value_info("y", 1, [2])])
    with pytest.raises(ModelLoadError, match="fails the ONNX checker"):
        souffle_py.optimize(model)


def test_graph_output_that_is_a_constant_and_an_input():
    """Edge cases of the output table: a folded constant and an input passed straight through."""
    c = helper.make_node("Constant", [], ["c"], value=onnx.numpy_helper.from_array(np.arange(3, dtype=np.float32)))
    ident = helper.make_node("Identity", ["x"], ["y"])
    model = _model([c, ident], [helper.make_tensor_value_info("x", 1, [3])],
                   [helper.make_tensor_value_info("c", 1, [3]), helper.make_tensor_value_info("y", 1, [3])])
    assert_matches_ort(model, {"x": np.ones(3, np.float32)})


@pytest.mark.parametrize("target,message", [("opencl", "target kind 'opencl' is not supported"),
                                            ("no-such-target", "unknown target 'no-such-target'")])
def test_targets_without_kernels_are_refused_clearly(target, message):
    from models.registry import build_model
    from souffle_py.baselines import unfused_tvm
    from souffle_py.errors import SouffleError

    proto = build_model("mmoe", tiny=True)
    for compile_model in (lambda: souffle_py.optimize(proto, target=target), lambda: unfused_tvm(proto, target)):
        with pytest.raises(SouffleError, match=message):
            compile_model()


def _several_unsupported_nodes():
    """Four problems in one graph: an op type without a rule (NonZero), one of another domain, an output no
    rule makes (MaxPool's Indices), and a node of an unknown op type reading the first one's output. The
    Relu reading the domain node's output is fine and is not reported."""
    f = helper.make_tensor_value_info
    nodes = [helper.make_node("NonZero", ["x"], ["nz"], name="n1"),
             helper.make_node("FastGelu", ["x"], ["fg"], name="n2", domain="com.microsoft"),
             helper.make_node("Relu", ["fg"], ["r"], name="n3"),
             helper.make_node("MaxPool", ["x"], ["sm", "idx"], name="n4", kernel_shape=[2, 2]),
             helper.make_node("Unique", ["nz"], ["u"], name="n5"),
             helper.make_node("Add", ["x", "x"], ["ok"], name="n6")]
    model = _model(nodes, [f("x", 1, [1, 2, 4, 4])], [f(o, 1, [1, 2, 4, 4]) for o in ("r", "ok")]
                   + [f("sm", 1, [1, 2, 3, 3]), f("u", 7, ["n"])])
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model


def test_every_unsupported_node_is_named_at_once(tmp_path, capsys):
    from souffle_py.cli import main
    from souffle_py.errors import UnsupportedNodesError

    with pytest.raises(UnsupportedNodesError) as caught:
        souffle_py.optimize(_several_unsupported_nodes())
    assert [e.node_name for e in caught.value.errors] == ["n1", "n2", "n4", "n5"]
    text = str(caught.value)
    assert text.startswith("4 nodes cannot be lowered")
    for expected in ["'n1' (NonZero): this operator type", "'n2' (FastGelu): operators of domain 'com.microsoft'",
                     "'n4' (MaxPool): the Indices output is not supported", "'n5' (Unique): this operator type"]:
        assert expected in text
    assert "'n3'" not in text
    onnx.save(_several_unsupported_nodes(), tmp_path / "m.onnx")
    assert main(["analyze", str(tmp_path / "m.onnx")]) == 2
    assert "4 nodes cannot be lowered" in capsys.readouterr().err


def test_bad_input_shapes_on_the_command_line_are_named(tmp_path, capsys):
    from souffle_py.cli import main

    onnx.save(_symbolic_model(), tmp_path / "m.onnx")
    for bad in ("x=1,three", "x", "x=1,-3"):
        assert main(["compile", str(tmp_path / "m.onnx"), "--input-shape", bad]) == 2
        assert "--input-shape" in capsys.readouterr().err


@pytest.mark.parametrize("shapes,what", [({"x": "abc"}, "sequence of positive integers"),
                                         ({"x": (2.5, 3)}, "sequence of positive integers"),
                                         ([("x", (2, 3))], "must be a dict")])
def test_malformed_input_shapes_are_shape_errors(shapes, what):
    with pytest.raises(ShapeError, match=what):
        souffle_py.optimize(_symbolic_model(), input_shapes=shapes)


def test_bad_counts_are_input_errors():
    model = souffle_py.optimize(_symbolic_model(), input_shapes={"x": (2, 3)})
    with pytest.raises(InputError, match="repeat must be an integer of at least 1"):
        model.benchmark(repeat=0)
    with pytest.raises(InputError, match="trials must be a non-negative integer"):
        souffle_py.optimize(_symbolic_model(), input_shapes={"x": (2, 3)}, trials=-5)
