"""Local buffers on the stack: the TIR pipeline souffle-py compiles with.

TVM 0.27 lowers every buffer of scope "local" (a GEMM's or conv's register-tile accumulator, the vector
lanes of a row reduction) to a TVMBackendAllocWorkspace / TVMBackendFreeWorkspace pair, and where the
buffer lives inside a parallel loop that pair runs once per tile or row: 114 call sites in
EfficientNet-b0, 4-6% of an inference's samples under `perf` in the workspace pool. Marked
"disable_lower_builtin" (TVM's own escape hatch, include/tvm/tirx/transform.h) a local buffer of constant
size is an LLVM alloca in the function's entry block instead, which LLVM keeps in registers where it can
(a 64 -> 64 1x1 conv over a 14 x 14 map: 142 -> 107 us). Buffers above STACK_LOCAL_BYTES keep the
workspace pool (a streamed conv's chunk accumulator, allocated once per chunk; threads' stacks are
finite).
"""

from __future__ import annotations

import math

import tvm
import tvm_ffi
from tvm import tirx
from tvm.s_tir.pipeline import default_s_tir_pipeline
from tvm.tirx import compilation_pipeline

from souffle_py.codegen.vector_rounding import vector_rounding_pass

PIPELINE = "souffle"
STACK_LOCAL_BYTES = 16 * 1024
DISABLE_LOWER_BUILTIN = "disable_lower_builtin"  # tvm::tirx::transform::kDisableLowerTVMBuiltin


def _on_stack(alloc: tirx.AllocBuffer) -> tirx.AllocBuffer:
    buffer = alloc.buffer
    if buffer.scope() != "local" or DISABLE_LOWER_BUILTIN in alloc.annotations:
        return alloc
    if not all(isinstance(d, tirx.IntImm) for d in buffer.shape):
        return alloc
    size = math.prod(int(d) for d in buffer.shape) * tvm.DataType(str(buffer.dtype)).itemsize
    if size > STACK_LOCAL_BYTES:
        return alloc
    return tirx.AllocBuffer(buffer, {**alloc.annotations, DISABLE_LOWER_BUILTIN: tirx.IntImm("int32", 1)})


@tirx.transform.prim_func_pass(opt_level=0, name="souffle.LocalBuffersOnStack")
def local_buffers_on_stack(func, _mod, _ctx):
    """`func` with its small constant-size local buffers marked to stay stack allocations."""
    return func.with_body(tvm_ffi.structural_map(func.body, [(tirx.AllocBuffer, _on_stack)]))


PREDICATION = "tirx.enable_buffer_level_predication"


def _cpu_only(mod: tvm.IRModule) -> bool:
    return all(str(func.attrs["target"].kind.name) == "llvm" for func in mod.functions.values()
               if func.attrs is not None and "target" in func.attrs)


def _masked_tails(lower):
    """TVM's lowering with masked vector tails on the CPU: a vectorized loop under a lane-dependent
    predicate (the last vector of a flattened run, schedule/flat.py) becomes masked loads and stores
    (AVX-512 mask registers) instead of per-lane gathers, and nearbyint in vector lanes (vector_rounding.py).
    GPU modules lower as TVM's default does."""

    @tvm.transform.module_pass(opt_level=0, name="souffle.LowerWithMaskedTails")
    def lower_with_masked_tails(mod, ctx):
        if not _cpu_only(mod):
            return lower(mod)
        mod = vector_rounding_pass(mod)  # before the vectorizer (vector_rounding.py)
        if ctx.config.get(PREDICATION) is not None:
            return lower(mod)
        with tvm.transform.PassContext(opt_level=ctx.opt_level, config={**ctx.config, PREDICATION: True},
                                       required_pass=list(ctx.required_pass), disabled_pass=list(ctx.disabled_pass)):
            return lower(mod)

    return lower_with_masked_tails


def _pipeline():
    lower, finalize_host, finalize_device = default_s_tir_pipeline()
    return (_masked_tails(lower), lambda: tvm.ir.transform.Sequential([local_buffers_on_stack, finalize_host()]),
            finalize_device)


compilation_pipeline.register_tir_pipeline(PIPELINE, _pipeline)
