"""codegen/kernels.py `in_bounds_regions`: a block's read regions clipped to its buffers' shapes. A concat
composed into its reader reads each branch at indices TVM takes the region from, whatever the condition: a
branch that never runs (MixNet int8: if_then_else(0 <= c, ..., s47[c + 40]) of a 40-channel map) read
past what its producer writes, the kernel's scope stopped being a "stage pipeline", and every later
cache_write + reverse_compute_at (a GEMM's or conv's register tiles) failed under SOUFFLE_STRICT."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import s_tir, te, tirx

from souffle_py.codegen.kernels import in_bounds_regions


def _concat_then_gemm():
    """a = x + 1, b = 2 w0 (4 x 16 each); y = the first 16 columns of concat(a, b), composed into one read
    (if_then_else(j < 16, a[i, j], b[i, j + 16]): the second branch never runs, but reads b[:, 16:32], past
    its 16 columns); z = y @ w1 (4 x 8)."""
    x = te.placeholder((4, 16), name="x")
    w0 = te.placeholder((4, 16), name="w0")
    w1 = te.placeholder((16, 8), name="w1")
    a = te.compute((4, 16), lambda i, j: x[i, j] + 1.0, name="a")
    b = te.compute((4, 16), lambda i, j: w0[i, j] * 2.0, name="b")
    y = te.compute((4, 16), lambda i, j: tirx.if_then_else(j < 16, a[i, j], b[i, j + 16]), name="y")
    k = te.reduce_axis((0, 16), name="k")
    z = te.compute((4, 8), lambda i, j: te.sum(y[i, k] * w1[k, j], axis=k), name="z")
    return [x, w0, w1, z]


def _reads(func, name):
    found = []
    tvm_ffi.structural_walk(func.body, [(s_tir.stmt.SBlock, lambda b: found.append(b) if b.name_hint == name else None)])
    return {str(r.source.name): r.region for r in found[0].reads}


def _tiles(func) -> None:
    sch = s_tir.Schedule(func)
    block = sch.get_sblock("z")
    loops = sch.get_loops(block)
    acc = sch.cache_write(block, 0, "local")
    sch.reverse_compute_at(acc, loops[0])


def test_a_folded_concat_reads_each_branch_within_its_map():
    func = te.create_prim_func(_concat_then_gemm())
    with pytest.raises(Exception, match="stage pipeline"):  # TVM's own regions: b[:, 16:32] of 16 columns
        _tiles(func)
    clipped = in_bounds_regions(func)
    before, after = _reads(func, "y"), _reads(clipped, "y")
    assert str(after["a"]) == str(before["a"])  # within its map: as TVM had it
    assert int(after["b"][1].min) == 15 and int(after["b"][1].extent) == 1  # b[:, j + 16] clipped to column 15
    _tiles(clipped)  # the scope is a stage pipeline again


def test_regions_already_in_bounds_are_left_alone():
    x = te.placeholder((8,), name="x")
    y = te.compute((8,), lambda i: x[i] * 2.0, name="y")
    func = te.create_prim_func([x, y])
    assert in_bounds_regions(func).same_as(func)


def test_values_are_unchanged():
    func = in_bounds_regions(te.create_prim_func(_concat_then_gemm()))
    lib = tvm.compile(func, target="llvm")
    rng = np.random.default_rng(0)
    x, w0, w1 = (rng.standard_normal(s).astype(np.float32) for s in ((4, 16), (4, 16), (16, 8)))
    out = tvm.runtime.tensor(np.zeros((4, 8), np.float32))
    lib["main"](*(tvm.runtime.tensor(v) for v in (x, w0, w1)), out)
    np.testing.assert_allclose(out.numpy(), (x + 1) @ w1, rtol=1e-5, atol=1e-5)
