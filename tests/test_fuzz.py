"""No internal errors: optimize() on random small ONNX graphs either matches ONNX Runtime or raises a
SouffleError subclass -- never another exception, never a hang.

Graphs are drawn by hypothesis (derandomized, so `make test` is reproducible): one to three inputs of
float32, int64 or bool, ranks 0-3 with broadcastable shapes, then up to five nodes chosen from a table of
op builders (elementwise with broadcasting, comparisons and bool logic, Where, Cast, reductions in their
attribute and input forms, Softmax, Transpose, Reshape, (Un)Squeeze, Gather with run-time int64 indices,
ArgMax, CumSum, Concat, MatMul). A fraction of nodes are deliberately broken (an out-of-range axis, an
unknown attribute, an op type nobody implements, shapes that do not broadcast); a broken model must be
refused with a SouffleError, by the checker or by the frontend.
"""

from __future__ import annotations

import logging
import signal

import numpy as np
import onnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

import souffle_py
from models.common import IR_VERSION
from souffle_py.baselines import OnnxRuntimeModel
from souffle_py.errors import SouffleError

EXAMPLES = 150
TIMEOUT_S = 120  # one compile of a five-node graph takes well under a second; a hang fails the test
RTOL, ATOL = 1e-4, 1e-5
ONNX_TYPE = {"float32": TensorProto.FLOAT, "int64": TensorProto.INT64, "bool": TensorProto.BOOL}


class _Graph:
    """Values (name -> (dtype, shape)) and nodes of the graph being drawn."""

    def __init__(self, draw):
        self.draw, self.nodes, self.inits, self.values, self.inputs = draw, [], [], {}, []
        self.opset = draw(st.sampled_from([13, 17, 18]))
        self.broken = False

    def new(self, dtype, shape) -> str:
        name = f"v{len(self.values)}"
        self.values[name] = (dtype, tuple(shape))
        return name

    def const(self, array) -> str:
        name = f"c{len(self.inits)}"
        self.inits.append(onnx.numpy_helper.from_array(np.asarray(array), name))
        return name

    def pick(self, dtypes=("float32", "int64", "bool")):
        names = [n for n, (d, _) in self.values.items() if d in dtypes]
        return self.draw(st.sampled_from(names)) if names else None

    def node(self, op, inputs, dtype, shape, **attrs) -> str:
        out = self.new(dtype, shape)
        self.nodes.append(helper.make_node(op, inputs, [out], **attrs))
        return out

    def axis(self, rank: int) -> int:
        """A valid axis, or (rarely) a broken one."""
        if self.draw(st.integers(0, 9)) == 7:
            self.broken = True
            return rank + 2
        return self.draw(st.integers(-max(rank, 1), max(rank - 1, 0)))


def _broadcast_partner(g: _Graph, shape):
    """A shape that broadcasts with `shape` (some dims dropped or set to 1)."""
    keep = g.draw(st.integers(0, len(shape)))
    return tuple(d if g.draw(st.booleans()) else 1 for d in shape[len(shape) - keep:])


def _binary(g, ops, dtypes, out_bool=False):
    a = g.pick(dtypes)
    if a is None:
        return
    dtype, shape = g.values[a]
    other = tuple(s + 1 for s in shape) if shape and g.draw(st.integers(0, 14)) == 7 else None
    if other is not None and not _broadcastable(shape, other):
        g.broken = True
    else:
        other = None
    b = g.new(dtype, other if other is not None else _broadcast_partner(g, shape))
    g.inputs.append(b)
    out_shape = shape if other is not None else np.broadcast_shapes(shape, g.values[b][1])
    g.node(g.draw(st.sampled_from(ops)), [a, b] if g.draw(st.booleans()) else [b, a],
           "bool" if out_bool else dtype, out_shape)


def _unary(g):
    a = g.pick(("float32",))
    if a is not None:
        op = g.draw(st.sampled_from(["Relu", "Sigmoid", "Tanh", "Exp", "Abs", "Neg", "Softplus", "Erf", "Floor",
                                     "Sin", "Round", "Sign"]))
        g.node(op, [a], "float32", g.values[a][1])


def _logic(g):
    a = g.pick(("bool",))
    if a is None:
        return
    if g.draw(st.booleans()):
        g.node("Not", [a], "bool", g.values[a][1])
    else:
        _binary(g, ["And", "Or", "Xor"], ("bool",), out_bool=True)


def _where(g):
    c, x = g.pick(("bool",)), g.pick(("float32", "int64"))
    if c is None or x is None:
        return
    shape = np.broadcast_shapes(g.values[c][1], g.values[x][1]) if _fits(g, c, x) else None
    if shape is None:
        return
    y = g.const(np.zeros((), dtype=g.values[x][0]))
    g.node("Where", [c, x, y], g.values[x][0], shape)


def _fits(g, a, b) -> bool:
    return _broadcastable(g.values[a][1], g.values[b][1])


def _broadcastable(a, b) -> bool:
    try:
        np.broadcast_shapes(a, b)
        return True
    except ValueError:
        return False


def _cast(g):
    a = g.pick()
    to = g.draw(st.sampled_from(["float32", "int64", "bool"]))
    if a is not None and not (g.values[a][0] == "float32" and to != "float32"):  # float->int: rounding differs
        g.node("Cast", [a], to, g.values[a][1], to=ONNX_TYPE[to])


def _reduce(g):
    a = g.pick(("float32",))
    if a is None or not g.values[a][1]:
        return
    shape = g.values[a][1]
    op = g.draw(st.sampled_from(["ReduceSum", "ReduceMean", "ReduceMax", "ReduceL2", "ReduceSumSquare",
                                 "ReduceLogSumExp", "ReduceProd", "ArgMax"]))
    axis = g.axis(len(shape))
    keep = g.draw(st.booleans())
    norm = axis % len(shape) if not g.broken else 0
    out = tuple(1 if i == norm else d for i, d in enumerate(shape) if keep or i != norm)
    if op == "ArgMax":
        g.node(op, [a], "int64", out, axis=axis, keepdims=int(keep))
    elif op == "ReduceSum" or g.opset >= 18:
        g.node(op, [a, g.const(np.array([axis], np.int64))], "float32", out, keepdims=int(keep))
    else:
        g.node(op, [a], "float32", out, axes=[axis], keepdims=int(keep))


def _movement(g):
    a = g.pick()
    if a is None:
        return
    dtype, shape = g.values[a]
    kind = g.draw(st.sampled_from(["Transpose", "Reshape", "Unsqueeze", "Softmax", "CumSum", "Concat"]))
    if kind == "Transpose" and shape:
        perm = g.draw(st.permutations(range(len(shape))))
        g.node(kind, [a], dtype, [shape[p] for p in perm], perm=list(perm))
    elif kind == "Reshape" and shape:
        g.node(kind, [a, g.const(np.array([-1], np.int64))], dtype, [int(np.prod(shape))])
    elif kind == "Unsqueeze":
        g.node(kind, [a, g.const(np.array([0], np.int64))], dtype, (1,) + shape)
    elif kind == "Softmax" and dtype == "float32" and shape:
        g.node(kind, [a], dtype, shape, axis=g.axis(len(shape)))
    elif kind == "CumSum" and dtype != "bool" and shape:
        g.node(kind, [a, g.const(np.array(g.axis(len(shape)), np.int64))], dtype, shape,
               reverse=int(g.draw(st.booleans())))
    elif kind == "Concat" and shape:
        g.node(kind, [a, a], dtype, (2 * shape[0],) + shape[1:], axis=0)


def _gather(g):
    a = g.pick(("float32",))
    if a is None or not g.values[a][1]:
        return
    shape = g.values[a][1]
    indices = g.new("int64", g.draw(st.sampled_from([(2,), (1, 3), ()])))
    g.inputs.append(indices)
    g.node("Gather", [a, indices], "float32", g.values[indices][1] + shape[1:], axis=0)


def _matmul(g):
    a = g.pick(("float32",))
    if a is None or len(g.values[a][1]) < 1:
        return
    k = g.values[a][1][-1]
    w = g.const(np.random.default_rng(len(g.nodes)).standard_normal((k, 3)).astype(np.float32))
    g.node("MatMul", [a, w], "float32", g.values[a][1][:-1] + (3,))


def _nonsense(g):
    a = g.pick()
    if a is None:
        return
    g.broken = True
    if g.draw(st.booleans()):
        g.node("NoSuchOp", [a], g.values[a][0], g.values[a][1])
    else:
        g.node("Relu", [a], g.values[a][0], g.values[a][1], not_an_attribute=1)


BUILDERS = [_unary, lambda g: _binary(g, ["Add", "Sub", "Mul", "Max", "Min"], ("float32", "int64")),
            lambda g: _binary(g, ["Less", "Greater", "Equal"], ("float32", "int64"), out_bool=True),
            _logic, _where, _cast, _reduce, _movement, _gather, _matmul, _nonsense]


@st.composite
def graphs(draw):
    g = _Graph(draw)
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=0, max_size=3)))
    for dtype in ["float32"] + draw(st.lists(st.sampled_from(["int64", "bool", "float32"]), max_size=2)):
        g.inputs.append(g.new(dtype, shape))
    for _ in range(draw(st.integers(2, 6))):
        draw(st.sampled_from(BUILDERS))(g)
    if not g.nodes:
        g.node("Identity", [g.inputs[0]], *g.values[g.inputs[0]])
    last = g.nodes[-1].output[0]
    graph = helper.make_graph(
        g.nodes, "fuzz", [helper.make_tensor_value_info(n, ONNX_TYPE[g.values[n][0]], g.values[n][1])
                          for n in g.inputs],
        [helper.make_tensor_value_info(last, ONNX_TYPE[g.values[last][0]], None)], g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", g.opset)], ir_version=IR_VERSION)
    try:  # the output's type as ONNX infers it (a broken graph keeps an untyped output: the checker refuses it)
        inferred = onnx.shape_inference.infer_shapes(model)
        model.graph.output[0].CopyFrom(inferred.graph.output[0])
    except Exception:
        pass
    return model, g.broken


def _feeds(model, seed=0):
    rng = np.random.default_rng(seed)
    feeds = {}
    for vi in model.graph.input:
        shape = [d.dim_value for d in vi.type.tensor_type.shape.dim]
        elem = vi.type.tensor_type.elem_type
        if elem == TensorProto.FLOAT:
            feeds[vi.name] = rng.standard_normal(shape).astype(np.float32)
        elif elem == TensorProto.INT64:
            feeds[vi.name] = rng.integers(-1, 2, shape).astype(np.int64)  # also valid Gather indices
        else:
            feeds[vi.name] = rng.integers(0, 2, shape).astype(bool)
    return feeds


class _Hang(Exception):
    pass


def _alarm(*_):
    raise _Hang(f"optimize() or run() took more than {TIMEOUT_S} s")


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large])
@given(graphs())
def test_random_graphs_match_or_raise_souffle_errors(case):
    model, broken = case
    logging.disable(logging.WARNING)
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(TIMEOUT_S)
    try:
        try:
            compiled = souffle_py.optimize(model, quiet=True)
            feeds = _feeds(model)
            ours = compiled.run(feeds)
        except SouffleError:
            return  # the clear error: fine for broken and unsupported graphs alike
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        logging.disable(logging.NOTSET)
    assert not broken, f"a deliberately broken graph compiled:\n{helper.printable_graph(model.graph)}"
    try:
        reference = OnnxRuntimeModel(model, threads=1).run(feeds)
    except Exception:  # ONNX Runtime lacks some kernels (e.g. Sign on bool): nothing to compare with
        return
    for name, expected in reference.items():
        assert ours[name].shape == expected.shape and ours[name].dtype == expected.dtype, name
        np.testing.assert_allclose(ours[name], expected, rtol=RTOL, atol=ATOL, equal_nan=True, err_msg=name)
