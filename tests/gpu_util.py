"""Test helpers for the CUDA backend on machines without a GPU."""

from __future__ import annotations

import tvm_ffi
from tvm import tirx

from souffle_py.backends.cuda.specs import gpu_present

HAS_GPU = gpu_present()


def threads_as_loops(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` with every GPU thread binding turned into a serial loop, so that LLVM can run it on the CPU.
    Valid for schedules whose threads do not cooperate through shared memory (one thread per output
    element, a host time loop): each thread's work then runs in turn, in launch order."""

    def serial(loop):
        if loop.kind != tirx.ForKind.THREAD_BINDING:
            return loop
        return tirx.For(loop.loop_var, loop.min, loop.extent, tirx.ForKind.SERIAL, loop.body)

    return tvm_ffi.structural_map(func, [(tirx.For, serial)])
