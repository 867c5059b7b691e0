"""Merge a subprogram (a set of TEs) into one kernel: one PrimFunc with every stage as an sblock and the
intermediates as buffers allocated inside the function.

External tensors become canonically named placeholders and the stages get canonical names, so that
identical subprograms (BERT's layers) produce structurally equal PrimFuncs and are compiled once.
"""

from __future__ import annotations

from typing import Sequence

from tvm import te

from souffle_py.codegen.kernels import Kernel, buffer_name, kernel_func
from souffle_py.program import TEProgram
from te_passes.graph import rebuild, tensor_key


def merged_kernel(program: TEProgram, ops: Sequence[te.ComputeOp], consumers, name: str, reason: str = "",
                  fast_math: bool = True) -> Kernel:
    """The kernel computing `ops` (in topological order); `consumers` is program.consumers()."""
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
        new_op = rebuild(op, mapping, name=f"s{index}")
        for i in range(op.num_outputs):
            new_of[tensor_key(op.output(i))] = new_op.output(i)
    outputs = [op.output(i) for op in ops for i in range(op.num_outputs)
               if tensor_key(op.output(i)) in program_outputs
               or any(c not in members for c in consumers.get(op, []))]
    func = kernel_func([*(fresh[tensor_key(t)] for t in external), *(new_of[tensor_key(t)] for t in outputs)],
                       fast_math)
    args = tuple(buffer_name(t) for t in external) + tuple(buffer_name(t) for t in outputs)
    return Kernel(name=name, func=func, args=args, stages=tuple(op.name for op in ops), reason=reason)
