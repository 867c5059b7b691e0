"""codegen/stack_locals.py: register-tile accumulators and other small local buffers are stack allocations,
not a workspace-pool call per tile; large ones keep the pool. Values are unchanged."""

import numpy as np
import tvm
from tvm import te

from souffle_py.codegen.build import compile_functions
from souffle_py.codegen.stack_locals import STACK_LOCAL_BYTES
from souffle_py.schedule.default import schedule_cpu
from souffle_py.target import resolve_target

TARGET = resolve_target("llvm")
WORKSPACE = "@__TVMBackendAllocWorkspace, align"  # each call site loads the function pointer once


def _conv():
    """A 1x1 conv in NCHW over 16 x 16 points: the GEMM rule's columns (the points) fill whole vector tiles, so
    no padded copy of them needs the pool."""
    x = te.placeholder((1, 64, 16, 16), name="x")
    w = te.placeholder((2, 64, 1, 1, 32), name="w")
    rc = te.reduce_axis((0, 64), name="rc")
    y = te.compute((1, 64, 16, 16), lambda n, f, i, j: te.sum(x[n, rc, i, j] * w[f // 32, rc, 0, 0, f % 32], axis=rc),
                   name="y")
    return schedule_cpu(te.create_prim_func([x, w, y])).with_attr("global_symbol", "conv")


def _run(executable, name, inputs, out_shape):
    args = [tvm.runtime.tensor(v) for v in inputs] + [tvm.runtime.tensor(np.zeros(out_shape, np.float32))]
    executable[name](*args)
    return args[-1].numpy()


def test_accumulators_are_stack_allocations_with_the_same_values():
    func = _conv()
    assert 'scope="local"' in func.script()  # the conv's register tile
    ours = compile_functions({"conv": func}, TARGET)
    tvm_default = tvm.compile(tvm.IRModule({"conv": func}), target=TARGET)
    assert tvm_default.mod.inspect_source("ll").count(WORKSPACE) >= 1
    assert ours.mod.inspect_source("ll").count(WORKSPACE) == 0
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal((1, 64, 16, 16)).astype(np.float32),
              rng.standard_normal((2, 64, 1, 1, 32)).astype(np.float32)]
    np.testing.assert_array_equal(_run(ours, "conv", inputs, (1, 64, 16, 16)),
                                  _run(tvm_default, "conv", inputs, (1, 64, 16, 16)))


def test_large_local_buffers_keep_the_workspace_pool():
    n = STACK_LOCAL_BYTES // 4 + 16  # floats: just over the limit
    x = te.placeholder((n,), name="x")
    y = te.compute((n,), lambda i: x[i] * 2.0, name="y")
    z = te.compute((n,), lambda i: y[i] + 1.0, name="z")
    sch = tvm.s_tir.Schedule(te.create_prim_func([x, z]))
    sch.set_scope(sch.get_sblock("y"), 0, "local")
    func = sch.mod["main"].with_attr("global_symbol", "big")
    built = compile_functions({"big": func}, TARGET)
    assert built.mod.inspect_source("ll").count(WORKSPACE) == 1
    value = np.arange(n, dtype=np.float32)
    np.testing.assert_array_equal(_run(built, "big", [value], (n,)), value * 2.0 + 1.0)
