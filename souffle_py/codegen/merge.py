"""Merge a subprogram (a set of TEs) into one kernel: one PrimFunc with every stage as an sblock and the
intermediates as buffers allocated inside the function.

External tensors become canonically named placeholders and the stages get canonical names, so that
identical subprograms (BERT's layers) produce structurally equal PrimFuncs and are compiled once. The step
TEs of a recurrence (an LSTM's) share one time loop and read the previous step in place (recurrence.py).
"""

from __future__ import annotations

from typing import Sequence

from tvm import te

from souffle_py.codegen.kernels import Kernel, buffer_name, kernel_func
from souffle_py.codegen.recurrence import Loop, roll_time_loops
from souffle_py.errors import SouffleError
from souffle_py.ir.program import TEProgram
from souffle_py.ir.graph import rebuild, tensor_key
from souffle_py.ir.marks import recurrences, state_of, without_marks


def merged_kernel(program: TEProgram, ops: Sequence[te.ComputeOp], consumers, name: str, reason: str = "",
                  fast_math: bool = True, global_intermediates: bool = False, local=()) -> Kernel:
    """The kernel computing `ops` (in topological order); `consumers` is program.consumers().

    global_intermediates: every stage's output is a parameter (a buffer the runtime allocates), and a
    recurrence's time loops are left to the scheduler to merge: a grid-synchronized GPU kernel cannot
    allocate global memory itself, and its time loop must sit inside the block and thread loops. The
    outputs of `local` ops (read only inside the kernel) stay inside even so: the schedule must compute
    them where they are read (a GEMM's prologue, grid.py)."""
    members = set(ops)
    program_outputs = {tensor_key(t) for t in program.outputs.values()}
    external, fresh = [], {}
    new_of = {}
    for index, op in enumerate(ops):
        for t in op.input_tensors:
            key = tensor_key(t)
            if t.op not in members and key not in fresh:
                fresh[key] = te.placeholder(t.shape, t.dtype, name=f"in{len(external)}")
                external.append(t)
        mapping = {**fresh, **new_of}
        new_op = rebuild(op, mapping, name=f"s{index}", attrs=without_marks(op.attrs))
        for i in range(op.num_outputs):
            new_of[tensor_key(op.output(i))] = new_op.output(i)
    # a recurrence's state lives across time steps: as a parameter, TVM cannot sink its allocation into
    # the time loop (which would give every step a fresh, uninitialized buffer)
    needed = [op.output(i) for op in ops for i in range(op.num_outputs)
              if tensor_key(op.output(i)) in program_outputs or state_of(op) is not None
              or any(c not in members for c in consumers.get(op, []))]
    needed_keys = {tensor_key(t) for t in needed}
    outputs = [op.output(i) for op in ops for i in range(op.num_outputs)
               if op not in local or tensor_key(op.output(i)) in needed_keys] if global_intermediates else needed
    loops = _recurrence_loops(program, ops, fresh, new_of, name)
    states = {state for loop in loops for state, _ in loop.back_edges}
    kept = [t for t in external if fresh[tensor_key(t)].op.name not in states]
    func = kernel_func([*(fresh[tensor_key(t)] for t in external), *(new_of[tensor_key(t)] for t in outputs)],
                       fast_math)
    if not global_intermediates:
        func = roll_time_loops(func, loops)
    args = tuple(buffer_name(t) for t in kept) + tuple(buffer_name(t) for t in outputs)
    return Kernel(name=name, func=func, args=args, stages=tuple(op.name for op in ops), reason=reason,
                  loops=tuple(loops))


def _recurrence_loops(program: TEProgram, ops, fresh, new_of, kernel: str) -> list[Loop]:
    """The recurrences among `ops`, by their names in the kernel; all members must be in the kernel."""
    loops = []
    everywhere = recurrences(program.stages)
    for recurrence, members in recurrences(ops).items():
        if len(members) != len(everywhere[recurrence]):
            raise SouffleError(f"kernel '{kernel}' holds only part of recurrence '{recurrence}' "
                               f"({len(members)} of {len(everywhere[recurrence])} step TEs)")
        edges = tuple((fresh[tensor_key(state_of(op))].op.name, new_of[tensor_key(op.output(0))].op.name)
                      for op in members if state_of(op) is not None)
        loops.append(Loop(tuple(new_of[tensor_key(op.output(0))].op.name for op in members), edges))
    return loops
