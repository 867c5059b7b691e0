"""The operator test cases that the onnx package ships, through the frontend and unfused execution.

Every case of onnx/backend/test/data/{pytorch-operator, pytorch-converted, simple} becomes one test:
- a case whose ops all have a lowering rule (Constant is folded) must compile and match the expected
  outputs stored with it (float32 tolerance RTOL/ATOL below);
- a case with other ops must be refused with UnsupportedError, the clear error, and is reported as skipped
  with the op names, so pytest's summary shows how many cases pass;
- the few cases in REFUSED need something the compiler does not do by design (data-dependent or empty
  shapes); they must raise the clear error listed there, and are skipped with the reason.
"""

from __future__ import annotations

import glob
import os

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from souffle_py.baselines import unfused_tvm
from souffle_py.errors import ShapeError, UnsupportedError
from souffle_py.frontend.context import RULES
from souffle_py.frontend.loader import graph_inputs

DATA = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data")
SUITES = ("pytorch-operator", "pytorch-converted", "simple")
FOLDED = {"Constant"}  # no rule needed: evaluated at compile time
RTOL, ATOL = 1e-4, 1e-5  # float32 (and float64) results against the stored outputs

# Cases that cannot compile by design, with the clear error they must raise and why.
REFUSED = {
    **{f"simple/test_expand_shape_model{i}": (UnsupportedError, "the target shape of Expand is a run-time input "
                                              "(a data-dependent shape)") for i in range(1, 5)},
    "simple/test_sequence_model8": (ShapeError, "its test input is empty (a zero dimension) and it uses sequence ops"),
}

CASES = sorted(os.path.relpath(d, DATA) for suite in SUITES for d in glob.glob(os.path.join(DATA, suite, "*"))
               if os.path.isfile(os.path.join(d, "model.onnx")))


def unsupported_ops(model: onnx.ModelProto) -> list[str]:
    """Op types without a lowering rule, with the domain for operators outside the default one."""
    missing = set()
    for node in model.graph.node:
        if node.domain not in ("", "ai.onnx"):
            missing.add(f"{node.domain}.{node.op_type}")
        elif node.op_type not in RULES and node.op_type not in FOLDED:
            missing.add(node.op_type)
    return sorted(missing)


def data_sets(case_dir: str) -> list[tuple[list[np.ndarray], list[np.ndarray]]]:
    """(inputs, expected outputs) of each test_data_set_* directory, in file order."""
    sets = []
    for set_dir in sorted(glob.glob(os.path.join(case_dir, "test_data_set_*"))):
        def read(kind):
            files = sorted(glob.glob(os.path.join(set_dir, f"{kind}_*.pb")),
                           key=lambda f: int(f.rsplit("_", 1)[1].split(".")[0]))
            return [numpy_helper.to_array(onnx.load_tensor(f)) for f in files]
        sets.append((read("input"), read("output")))
    return sets


def test_the_suites_are_there():
    assert len(CASES) > 100, f"expected the onnx package's backend test data under {DATA}"


@pytest.mark.parametrize("case", CASES)
def test_case(case):
    case_dir = os.path.join(DATA, case)
    model = onnx.load(os.path.join(case_dir, "model.onnx"))
    sets = data_sets(case_dir)
    names = [vi.name for vi in graph_inputs(model)]
    shapes = {name: array.shape for name, array in zip(names, sets[0][0])}  # the data fixes symbolic dims
    missing = unsupported_ops(model)
    if case in REFUSED:
        error, reason = REFUSED[case]
        with pytest.raises(error):
            unfused_tvm(model, input_shapes=shapes)
        pytest.skip(reason)
    if missing:
        with pytest.raises(UnsupportedError):
            unfused_tvm(model, input_shapes=shapes)
        pytest.skip(f"unsupported ops {missing}")
    compiled = unfused_tvm(model, input_shapes=shapes)
    for inputs, expected in sets:
        outputs = list(compiled.run(dict(zip(names, inputs))).values())
        assert len(outputs) == len(expected)
        for got, want in zip(outputs, expected):
            assert got.shape == want.shape and got.dtype == want.dtype
            np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
