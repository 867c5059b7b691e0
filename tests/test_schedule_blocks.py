"""schedule/blocks.py: the block queries the schedule rules decide by."""

import tvm
import tvm_ffi
from tvm import s_tir, te, topi

from souffle_py.schedule.blocks import block_kind, block_loops, lane_access, loop_extent, uses


def _schedule(*tensors):
    return s_tir.Schedule(te.create_prim_func(list(tensors)))


def test_block_kinds():
    a = te.placeholder((8, 16), name="a")
    b = te.placeholder((16, 32), name="b")
    k = te.reduce_axis((0, 16), "k")
    gemm = te.compute((8, 32), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k), name="gemm")
    x = te.placeholder((1, 4, 8, 8), name="x")
    w = te.placeholder((4, 4, 3, 3), name="w")
    conv = topi.nn.conv2d_nchw(x, w, 1, 0, 1)
    kinds = {}
    for tensors in ([a, b, gemm], [x, w, conv], [a, topi.sum(a, axis=1)], [x, topi.nn.pad(x, (0, 0, 1, 1))],
                    [a, topi.exp(a)]):
        sch = _schedule(*tensors)
        block = sch.get_sblock(tensors[-1].op.name)
        kinds[tensors[-1].op.name] = block_kind(sch, block)
    assert sorted(kinds.values()) == ["conv", "gemm", "injective", "pad", "reduction"]
    assert kinds["gemm"] == "gemm"


def test_loops_and_extents():
    a = te.placeholder((8, 16), name="a")
    sch = _schedule(a, te.compute((8, 16), lambda i, j: a[i, j] + 1.0, name="add"))
    loops = block_loops(sch, sch.get_sblock("add"))
    assert [loop_extent(sch, loop) for loop in loops] == [8, 16]


def _load(index):
    """The load x[index(i, j)] of a block over (i, j), and the block's j."""
    x = te.placeholder((4, 64), name="x")
    sch = _schedule(x, te.compute((4, 64), lambda i, j: x[index(i, j)] * 2.0, name="y"))
    stmt = sch.get(sch.get_sblock("y"))
    loads = []
    tvm_ffi.structural_walk(stmt.body, [(tvm.ir.expr.TensorLoad, loads.append)])
    return loads[0], stmt.iter_vars[1].var


def test_lane_access_classifies_loads_along_a_vector_axis():
    assert lane_access(*_load(lambda i, j: (i, j)), 16) == "contiguous"
    assert lane_access(*_load(lambda i, j: (i, 0)), 16) == "invariant"
    assert lane_access(*_load(lambda i, j: (j % 4, i)), 16) == "gather"
    load, j = _load(lambda i, j: (i, j))
    assert uses(load, j) and not uses(_load(lambda i, j: (i, 0))[0], j)


def test_a_flatten_composed_into_a_read_is_contiguous_in_the_flattened_buffer():
    """AlexNet's classifier reads its [1, 256, 6, 6] input flattened, X[0, k // 36, k % 36 // 6, k % 6]:
    contiguous once the buffer is flattened (its first Gemm ran as scalars: 2.5 GFLOP/s, 30 of 41 ms)."""
    x = te.placeholder((1, 256, 6, 6), name="x")
    w = te.placeholder((64, 9216), name="w")
    for index, access in [(lambda k: (0, k // 36, k % 36 // 6, k % 6), "contiguous"),
                          (lambda k: (0, k % 256, k // 256 // 6, k // 256 % 6), "gather")]:
        k = te.reduce_axis((0, 9216), "k")
        y = te.compute((1, 64), lambda i, j: te.sum(x[index(k)] * w[j, k], axis=k), name="y")
        sch = _schedule(x, w, y)
        stmt = sch.get(sch.get_sblock("y"))
        loads = []
        tvm_ffi.structural_walk(stmt.body, [(tvm.ir.expr.TensorLoad, loads.append)])
        data = next(ld for ld in loads if ld.source.name == "x")
        assert lane_access(data, stmt.iter_vars[-1].var, 16) == access
