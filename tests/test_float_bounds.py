"""codegen/float_bounds.py: bounds from 8-bit leaves, constants and clamps; none from a float load, an int32
accumulator or a min / max whose second operand may be NaN."""

import math

from tvm import te, tirx

from souffle_py.codegen.float_bounds import bounds

F32 = "float32"


def test_a_residual_sum_of_8_bit_maps_is_bounded():
    acc = te.placeholder((4,), "int32", name="acc")
    res = te.placeholder((4,), "int8", name="res")
    requantized = tirx.min(tirx.max(tirx.nearbyint(acc[0].astype(F32) * 0.01), tirx.const(-130.0, F32)),
                           tirx.const(125.0, F32))
    total = requantized * 0.5 + (res[0].astype("int32") + 128).astype(F32) * 0.25
    assert bounds(requantized) == (-130.0, 125.0)
    assert bounds(total) == (-65.0, 125.0 * 0.5 + 255 * 0.25)


def test_float_loads_and_int32_sums_are_unbounded():
    acc = te.placeholder((4,), "int32", name="acc")
    x = te.placeholder((4,), F32, name="x")
    assert bounds(acc[0].astype(F32) * 0.5) == (-math.inf, math.inf)
    assert bounds(x[0] + 1.0) == (-math.inf, math.inf)
    assert bounds(tirx.min(tirx.const(3.0, F32), x[0])) == (-math.inf, math.inf)  # min(3, NaN) is NaN
    assert bounds(tirx.min(x[0], tirx.const(3.0, F32))) == (-math.inf, 3.0)        # min(NaN, 3) is 3
