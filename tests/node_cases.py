"""The onnx package's node test cases (onnx.backend.test.case.node), run through souffle_py.optimize().

The onnx wheel does not ship onnx/backend/test/data/node; the same cases (model + inputs + expected
outputs, ~1900 of them including the `_expanded` function-body variants) are generated in a few seconds by
`collect_testcases`, which is what writes that directory in the onnx repository.

Node tests feed shape-like arguments (Reshape's shape, Reduce axes, Slice starts, TopK's k...) as graph
inputs; a real exported model has them as initializers. souffle-py compiles for concrete shapes, so when
the frontend reports such an input with NotConstantError, `compile_case` turns that graph input into an
initializer holding the test's value and compiles again (a case with several data sets that disagree on
the value is not frozen).
"""

from __future__ import annotations

import functools
import warnings

import numpy as np
import onnx
from onnx import numpy_helper

import souffle_py
from souffle_py.errors import NotConstantError, UnsupportedError
from souffle_py.frontend.context import RULES
from souffle_py.frontend.loader import graph_inputs

FOLDED = {"Constant"}  # evaluated at compile time, no rule
RTOL, ATOL = 1e-4, 1e-5  # our float32 tolerance; a case's own (looser) tolerance wins
FP16_TOL = 4e-3  # float16: a few units in the last place (2^-10 ~ 1e-3 relative)


@functools.lru_cache(maxsize=1)
def all_cases() -> dict:
    """name -> onnx TestCase, every node case the onnx package generates."""
    from onnx.backend.test.case import node

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        return {case.name: case for case in node.collect_testcases(None)}


def op_types(model: onnx.ModelProto) -> set[str]:
    """The op types of the main graph (domain-qualified outside the default domain)."""
    return {n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}.{n.op_type}" for n in model.graph.node}


def missing_ops(model: onnx.ModelProto) -> list[str]:
    return sorted(op for op in op_types(model) if op not in RULES and op not in FOLDED)


def main_op(case) -> str:
    """The op type a case is about: its single node's, or for an _expanded case the original op's."""
    nodes = case.model.graph.node
    if len(nodes) == 1:
        return nodes[0].op_type
    return _op_of_name(case.name)


@functools.lru_cache(maxsize=1)
def _op_names() -> dict:
    names = {}
    for case in all_cases().values():
        if len(case.model.graph.node) == 1 and "_expanded" not in case.name:
            names[case.name] = case.model.graph.node[0].op_type
    return names


def _op_of_name(name: str) -> str:
    base = name.split("_expanded")[0]
    names = _op_names()
    while base and base not in names:
        base = base.rsplit("_", 1)[0] if "_" in base else ""
    return names.get(base, "(function)")


def _freeze(model: onnx.ModelProto, name: str, value: np.ndarray) -> onnx.ModelProto:
    frozen = onnx.ModelProto()
    frozen.CopyFrom(model)
    keep = [vi for vi in frozen.graph.input if vi.name != name]
    del frozen.graph.input[:]
    frozen.graph.input.extend(keep)
    frozen.graph.initializer.append(numpy_helper.from_array(np.asarray(value), name))
    return frozen


def as_array(value):
    """A data-set value as numpy (cases store exotic dtypes as TensorProto, scalars as numpy scalars);
    sequences and optionals stay as they are (souffle-py refuses such inputs)."""
    if isinstance(value, onnx.TensorProto):
        return numpy_helper.to_array(value)
    if isinstance(value, (list, tuple)) or value is None:
        return value
    return np.asarray(value)


def _present_inputs(model):
    return [vi.name for vi in model.graph.input]


def compile_case(case, **options):
    """(compiled model, the model compiled, frozen input names): shape-like graph inputs frozen as needed."""
    model = case.model
    values = [dict(zip(_present_inputs(model), map(as_array, inputs))) for inputs, _ in case.data_sets]
    # an empty input (Reduce's axes=[], CastLike's `like`) can only be a constant: TVM has no zero-size buffers
    frozen = [name for name, v in values[0].items()
              if isinstance(v, np.ndarray) and v.size == 0 and v.dtype != object
              and all(np.array_equal(other[name], v) for other in values[1:])]
    for name in frozen:
        model = _freeze(model, name, values[0][name])
    while True:
        shapes = {vi.name: values[0][vi.name].shape for vi in graph_inputs(model)
                  if isinstance(values[0].get(vi.name), np.ndarray)}
        try:
            return souffle_py.optimize(model, input_shapes=shapes, quiet=True, **options), model, frozen
        except UnsupportedError as exc:  # NotConstantError, or several nodes' at once (UnsupportedNodesError)
            errors = getattr(exc, "errors", [exc])
            names = list(dict.fromkeys(e.value_name for e in errors if isinstance(e, NotConstantError)))
            if not all(isinstance(e, NotConstantError) for e in errors) or any(
                    name in frozen or not isinstance(values[0].get(name), np.ndarray)
                    or any(not np.array_equal(v[name], values[0][name]) for v in values[1:]) for name in names):
                raise
            for name in names:
                model = _freeze(model, name, values[0][name])
                frozen.append(name)


def check_case(case, **options) -> None:
    """Compile the case and compare every data set's outputs with the expected ones (AssertionError if not)."""
    compiled, model, frozen = compile_case(case, **options)
    rtol, atol = max(RTOL, case.rtol), max(ATOL, case.atol)
    for inputs, expected in case.data_sets:
        feeds = {k: as_array(v) for k, v in zip(_present_inputs(case.model), inputs) if k not in frozen}
        outputs = list(compiled.run(feeds).values())
        assert len(outputs) == len(expected), f"{len(outputs)} outputs, expected {len(expected)}"
        for got, want in zip(outputs, expected):
            want = as_array(want)
            assert got.shape == want.shape, f"shape {got.shape}, expected {want.shape}"
            assert got.dtype == want.dtype, f"dtype {got.dtype}, expected {want.dtype}"
            if want.dtype.kind in "biu":
                np.testing.assert_array_equal(got, want)
            elif want.dtype == np.float16:  # the reference rounds float32 intermediates differently
                np.testing.assert_allclose(got, want, rtol=max(rtol, FP16_TOL), atol=max(atol, FP16_TOL))
            else:
                np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)
