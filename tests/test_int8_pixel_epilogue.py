"""te_passes/int8_pixel_epilogue.py: the elementwise reader of a padded pixel-lane sum laid over the padded
pixels (before / expected on a small TE program, values equal), and what it leaves alone."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import te, tirx

from souffle_py.ir.graph import map_loads
from souffle_py.ir.program import TEProgram
from te_passes.int8_conv_vnni import PIXEL_LANES
from te_passes.int8_pixel_epilogue import flat_padded_epilogues, padded_sums_read

F, H, W, P = 16, 3, 3, 16  # 9 pixels padded to one vector of 16


def _program(padded: bool = True, as_output: bool = False):
    x = te.placeholder((1, F, P), "int32", name="x")
    res = te.placeholder((1, F, H, W), "int32", name="res")
    pixels = P if padded else H * W
    total = te.compute((1, F, pixels), lambda n, f, p: x[n, f, tirx.min(p, P - 1)] * 2, name="sum",
                       attrs={PIXEL_LANES: 1})
    epilogue = te.compute((1, F, H, W), lambda n, f, h, w: total[n, f, h * W + w] + res[n, f, h, w], name="epilogue")
    reader = te.compute((1, F, H, W), lambda n, f, h, w: epilogue[n, f, h, w] + 1, name="reader")
    out = epilogue if as_output else reader
    return TEProgram(inputs={"x": x, "res": res}, params={}, param_tensors={}, outputs={"y": out}), x, res


def _reads(op) -> dict:
    found = {}
    map_loads(op.body[0], lambda t, idx: found.setdefault(t.op.name, [str(i) for i in idx]) and None)
    return found


def _run(program, x, res, xv, rv):
    out = program.outputs["y"]
    lib = tvm.compile(te.create_prim_func([x, res, out]), target="llvm")
    buf = tvm.runtime.empty([int(d) for d in out.shape], out.dtype)
    lib(tvm.runtime.tensor(xv), tvm.runtime.tensor(rv), buf)
    return buf.numpy()


def test_the_reader_of_a_padded_sum_runs_over_the_padded_pixels_with_the_same_values():
    before, x, res = _program()
    after = flat_padded_epilogues(before)
    (flat,) = [op for op in after.stages if op.name == "epilogue"]
    assert [int(d) for d in flat.output(0).shape] == [1, F, P]  # E' over the padded pixels
    reads = _reads(flat)
    p = str(flat.axis[2].var)
    assert reads["sum"] == ["n", "f", p]  # the sum at p: the write-back's own point
    assert reads["res"][2:] == [f"T.min({p}, 8) // 3", f"T.min({p}, 8) % 3"]  # the other map, clamped pixel
    (reader,) = [op for op in after.stages if op.name == "reader"]
    assert _reads(reader)["epilogue"][2] == "h * 3 + w"  # its reader picks the real pixels
    rng = np.random.default_rng(0)
    xv = rng.integers(-100, 100, (1, F, P)).astype("int32")
    rv = rng.integers(-100, 100, (1, F, H, W)).astype("int32")
    np.testing.assert_array_equal(_run(after, x, res, xv, rv), _run(before, x, res, xv, rv))


def test_an_unpadded_sum_or_a_program_output_is_left_alone():
    for program in (_program(padded=False)[0], _program(as_output=True)[0]):
        assert flat_padded_epilogues(program) is program


def test_a_reader_that_reads_the_sum_elsewhere_is_not_an_epilogue():
    x = te.placeholder((1, F, P), "int32", name="x")
    total = te.compute((1, F, P), lambda n, f, p: x[n, f, p], name="sum", attrs={PIXEL_LANES: 1})
    shifted = te.compute((1, F, H, W), lambda n, f, h, w: total[n, f, h * W + w] + total[n, f, 0], name="shifted")
    assert padded_sums_read(shifted.op) == []
