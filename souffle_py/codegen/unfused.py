"""The unfused reference: every TE its own kernel ("unfused TVM"), each isolated over canonically named
placeholders so that identical computations (BERT's layers) hash equal and compile once.
"""

from __future__ import annotations

from souffle_py.codegen.kernels import Kernel, buffer_name, kernel_func
from souffle_py.codegen.merge import merged_kernel
from souffle_py.ir.program import TEProgram
from souffle_py.ir.graph import isolate
from souffle_py.ir.marks import member_of, recurrences


def unfused_kernels(program: TEProgram, fast_math: bool = True) -> list[Kernel]:
    """One kernel per compute op, in topological order; the step TEs of a recurrence (which must share a
    time loop) make one kernel, at the place of their first TE."""
    kernels = []
    loops = recurrences(program.stages)
    consumers = program.consumers() if loops else {}
    for op in program.stages:
        recurrence = member_of(op)
        if recurrence is not None:
            if op.same_as(loops[recurrence][0]):
                kernels.append(merged_kernel(program, loops[recurrence], consumers, recurrence, fast_math=fast_math))
            continue
        inputs, outputs = isolate(op, name="stage")
        func = kernel_func([*inputs, *outputs], fast_math)
        args = tuple(buffer_name(t) for t in op.input_tensors) + tuple(
            buffer_name(op.output(i)) for i in range(op.num_outputs))
        kernels.append(Kernel(name=op.name, func=func, args=args, stages=(op.name,)))
    return kernels
