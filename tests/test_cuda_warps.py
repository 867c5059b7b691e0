"""Warp-per-output reductions in grid kernels (backends/cuda/warps.py) without a GPU: which reductions get
them, the shuffles and guarded write-backs in the generated CUDA, outputs shifted along the grid instead of
rotated block indices, and their phase-by-phase CPU runs."""

import numpy as np
import tvm
import tvm_ffi
from tvm import te, tirx

from souffle_py.backends import backend_for
from souffle_py.backends.cuda import cuda_source
from souffle_py.backends.cuda.barriers import GRID_SYNC
from souffle_py.backends.cuda.split_k import split_for
from souffle_py.backends.cuda.warps import shift_outputs, unlowered_warp_reductions
from souffle_py.codegen.build import schedule_kernels
from souffle_py.partition import H100
from souffle_py.ir.program import TEProgram
from gpu_util import run_phases_on_cpu
from souffle_py.ir.exprs import substitute
from te_passes.split_reduction import Split


def test_warp_reductions_split_only_beyond_their_lanes():
    """A reduction along rows (its lanes read adjacent elements) gets a warp per output: 1024 terms are 32
    per lane and stay whole; 32768 terms over 16 rows are 1024 per lane and split."""

    def rows(n, terms):
        x = te.placeholder((n, terms), "float32", name="x")
        r = te.reduce_axis((0, terms), name="r")
        return te.compute((n,), lambda i: te.sum(x[i, r] * x[i, r], axis=r), name="rows").op

    assert split_for(rows(128, 1024), H100) is None
    assert split_for(rows(16, 32768), H100) == Split(32)


def test_warp_reductions_use_shuffles_and_guard_their_write_back():
    """A row reduction's 1000 outputs as warps of a 528-block grid: lanes combine by warp shuffles, the
    write-back is guarded by the output bound (TVM 0.27 drops a one-clause predicate there, and blocks
    past the last output would write out of bounds), a second reduction reading the first in its own
    warp waits at __syncwarp, not a grid barrier, and the element-wise square root after it runs in the
    warp's loop nest; run phase by phase on the CPU, the results are right."""

    x = te.placeholder((1000, 256), "float32", name="x")
    r = te.reduce_axis((0, 256), name="r")
    mean = te.compute((1000,), lambda i: te.sum(x[i, r] / 256.0, axis=r), name="mean")
    q = te.reduce_axis((0, 256), name="q")
    var = te.compute((1000,), lambda i: te.sum((x[i, q] - mean[i]) * (x[i, q] - mean[i]) / 256.0, axis=q),
                     name="var")
    std = te.compute((1000,), lambda i: te.sqrt(var[i] + 1e-5), name="std")  # computed by the var warp's lane 0
    program = TEProgram(inputs={"x": x}, params={}, param_tensors={}, outputs={"var": var, "std": std})
    backend = backend_for("h100")
    kernel = backend._grid_kernel(program, program.stages, program.consumers(), "", blocks=528)
    scheduled = schedule_kernels([kernel], backend.default_scheduler())
    (func,) = scheduled.functions.values()
    assert GRID_SYNC not in func.script() and "__syncwarp" in func.script()
    source = cuda_source(tvm.compile(tvm.IRModule({"main": func}), target=backend.target))
    assert source.count("= __shfl_down_sync(") == 2 * 5  # log2(32) steps per reduction
    write_backs = [line for line in source.splitlines() if "threadIdx.x) == 0" in line]
    assert len(write_backs) == 3 and all("blockIdx.x" in line for line in write_backs)  # mean, var, std
    model = run_phases_on_cpu(program, [kernel], scheduled.functions, scheduled.function_of)
    feeds = program.random_feeds()
    results = model.run(feeds)
    np.testing.assert_allclose(results["var"], feeds["x"].var(axis=1), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(results["std"], np.sqrt(feeds["x"].var(axis=1) + 1e-5), rtol=1e-4)


def test_independent_warp_reductions_of_one_phase_all_lower_to_shuffles():
    """Three independent row sums in one phase, 13 blocks each: each is a warp reduction (5 shuffles each)
    and they run on blocks 0-12, 13-25 and 26-38. Their outputs are shifted along the grid
    (warps.shift_outputs), not their block index rotated as other stages' are: TVM lowers a cross-thread
    reduction only from affine block iterators; a warp stage that does not lower (a rotated one, here)
    is detected, so that its kernel falls back."""

    xs = [te.placeholder((100, 256), "float32", name=f"x{i}") for i in range(3)]
    def row_sum(x, i):
        r = te.reduce_axis((0, 256), name="r")
        return te.compute((100,), lambda j: te.sum(x[j, r], axis=r), name=f"sum{i}")

    outputs = {f"s{i}": row_sum(x, i) for i, x in enumerate(xs)}
    program = TEProgram(inputs={f"x{i}": x for i, x in enumerate(xs)}, params={}, param_tensors={},
                        outputs=outputs)
    backend = backend_for("h100")
    kernel = backend._grid_kernel(program, program.stages, program.consumers(), "", blocks=64)
    scheduled = schedule_kernels([kernel], backend.default_scheduler())
    (func,) = scheduled.functions.values()
    source = cuda_source(tvm.compile(tvm.IRModule({"main": func}), target=backend.target))
    assert source.count("= __shfl_down_sync(") == 3 * 5
    assert "(13 <= ((int)blockIdx.x))" in source and "(26 <= ((int)blockIdx.x))" in source
    model = run_phases_on_cpu(program, [kernel], scheduled.functions, scheduled.function_of)
    feeds = program.random_feeds()
    for i in range(3):
        np.testing.assert_allclose(model.run(feeds)[f"s{i}"], feeds[f"x{i}"].sum(axis=1), rtol=1e-5, atol=1e-5)
    block = next(f.loop_var for f in _loops(func) if f.thread_binding is not None
                 and str(f.thread_binding.thread_tag) == "blockIdx.x")
    rotation = {block.__chandle__(): tirx.floormod(block + 1, 64)}
    rotated = tvm_ffi.structural_map(func, [(tvm.s_tir.stmt.SBlockRealize, lambda r: tvm.s_tir.stmt.SBlockRealize(
        [substitute(v, rotation) for v in r.iter_values], r.predicate, r.block))])
    assert unlowered_warp_reductions(func) == [] and len(unlowered_warp_reductions(rotated)) == 3


def _loops(func):
    loops = []
    tvm_ffi.structural_walk(func.body, [(tirx.For, loops.append)])
    return loops


def test_shifted_outputs_compute_the_same_values():
    """shift_outputs moves a block's outputs along a flattened, longer axis whose first points are
    predicated off: the same values, a recurrence's leading time axis kept."""
    x = te.placeholder((3, 5, 70), "float32", name="x")
    r = te.reduce_axis((0, 70), name="r")
    y = te.compute((3, 5), lambda t, i: te.sum(x[t, i, r] * 2.0, axis=r), name="y")
    func = te.create_prim_func([x, y]).with_attr("global_symbol", "main")
    shifted = shift_outputs(func, {"y": 24}, recurrent={"y"})
    loops = []
    tvm_ffi.structural_walk(shifted.body, [(tirx.For, loops.append)])
    assert sorted(int(loop.extent) for loop in loops) == [3, 5 + 24, 70]  # time, flattened + shift, reduction
    data = np.random.default_rng(0).standard_normal((3, 5, 70)).astype("float32")
    results = []
    for f in (func, shifted):
        out = tvm.runtime.tensor(np.zeros((3, 5), "float32"))
        tvm.compile(tvm.IRModule({"main": f}), target="llvm")(tvm.runtime.tensor(data), out)
        results.append(out.numpy())
    np.testing.assert_allclose(results[1], results[0], rtol=1e-6)


def test_which_reductions_take_a_warp_per_output():
    """Warps where lanes read adjacent terms; not over an operand's rows (x . W with W[k, j]), not a
    max from -inf (TVM's cross-thread reduction does not match it), not a sum repeated along an output
    axis it does not read (TVM's scope then stops being a stage pipeline: sbert's mask sum)."""
    from souffle_py.backends.cuda.warps import warp_reduced

    def block_of(tensor):
        blocks = []
        func = te.create_prim_func([*tensor.op.input_tensors, tensor])
        tvm_ffi.structural_walk(func.body, [(tvm.s_tir.stmt.SBlock, blocks.append)])
        return next(b for b in blocks if b.name_hint == tensor.op.name)

    x = te.placeholder((16, 256), "float32", name="x")
    w = te.placeholder((256, 64), "float32", name="w")
    mask = te.placeholder((1, 128), "int64", name="mask")
    r = te.reduce_axis((0, 256), name="r")
    rows = te.compute((16,), lambda i: te.sum(x[i, r], axis=r), name="rows")
    assert warp_reduced(block_of(rows))
    k = te.reduce_axis((0, 256), name="k")
    assert not warp_reduced(block_of(te.compute((16, 64), lambda i, j: te.sum(x[i, k] * w[k, j], axis=k),
                                                name="xw")))
    m = te.reduce_axis((0, 256), name="m")
    minus_inf = te.comm_reducer(lambda a, b: tirx.max(a, b), lambda t: tirx.const(-np.inf, t), name="max_inf")
    assert not warp_reduced(block_of(te.compute((16,), lambda i: minus_inf(x[i, m], axis=m), name="mx")))
    t = te.reduce_axis((0, 128), name="t")
    counts = te.compute((1, 384), lambda b, j: te.sum(mask[0, t].astype("float32"), axis=t), name="counts")
    assert not warp_reduced(block_of(counts))
