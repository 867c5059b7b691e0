"""ONNX node conformance: every node test case of the onnx package (tests/node_cases.py) through optimize().

- a case whose ops all have a lowering rule must compile with the default passes and match the stored
  outputs (float32 1e-4 relative or the case's own looser tolerance);
- a case with other ops, and a case in REFUSED (something the compiler does not do by design), must raise
  a SouffleError subclass -- never another exception -- and is reported as skipped with the reason;
- nothing may hang: the whole module runs in about two minutes on two cores.

The pass counts by op type are in docs/conformance.md (`python tests/node_cases.py` regenerates it).
"""

from __future__ import annotations

import logging
import re

import pytest

from node_cases import all_cases, check_case, missing_ops
from souffle_py.errors import SouffleError

# Cases whose ops all have rules but that the compiler refuses by design, by name pattern, with the reason.
REFUSED = {
    r"_empty_set|_zero_size_splits|test_reshape_allowzero_reordered":
        "a zero-size tensor (TVM allocates no empty buffers)",
    r"BFLOAT16|bfloat16|_bf16|FLOAT8|FLOAT4|INT4|UINT4|INT2|UINT2|e8m0|_string":
        "an element type TVM does not compute with (bfloat16, float8, float4, int2/int4, string)",
    r"training": "training mode (souffle-py compiles inference)",
    r"window.*_expanded|center_crop_pad.*_expanded":
        "a value computed at run time decides an output shape (Range, Pad)",
    r"test_identity_opt|test_identity_sequence": "optional and sequence inputs",
    r"ceil_last_window_starts_on_pad|ceil_output_size_reduce_by_one":
        "ceil_mode with a last window in the padding (ONNX shape inference and ONNX Runtime disagree)",
    r"test_maxpool_with_argmax": "MaxPool's Indices output",
    r"test_resize_.*(cubic|antialias|tf_crop_and_resize)": "Resize's cubic, antialias and crop modes",
    r"^test_mvn$": "the onnx checker's shape inference rejects the model",
    r"quantizelinear_(u?int[24]|float4e2m1|e4m3fn|e5m2)":
        "an element type TVM does not compute with (int2/int4, float4, float8)",
    r"quantizelinear_blocked": "block quantization (block_size)",
    r"qlinearmatmul_.*_float16": "float16 quantization scales (float32 only)",
    r"test_convinteger_|^test_qlinearconv$":
        "a zero point fed at run time (zero points are compensated at compile time: docs/precision.md)",
}


def refusal_reason(name: str) -> str | None:
    return next((reason for pattern, reason in REFUSED.items() if re.search(pattern, name)), None)


CASES = sorted(all_cases())


def test_the_cases_are_there():
    assert len(CASES) > 1000, "expected the onnx package's node test cases"


@pytest.mark.parametrize("name", CASES)
def test_node_case(name, caplog):
    caplog.set_level(logging.ERROR)
    case = all_cases()[name]
    missing = missing_ops(case.model)
    reason = f"ops without a lowering rule: {missing}" if missing else refusal_reason(name)
    try:
        check_case(case)  # any exception but a SouffleError fails the test, and so does a wrong result
    except SouffleError:
        if reason is None:
            raise
        pytest.skip(reason)
