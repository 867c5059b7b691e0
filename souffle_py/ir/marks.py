"""Recurrences in a TE program: time-step TEs over a [T, ...] domain that read their own earlier steps.

A TE program is acyclic, so the frontend writes a recurrence (an RNN's hidden and cell state) as TEs over
all T steps that read a *state placeholder*: state[t] stands for source[t - 1] and is only read under
`if_then_else(t == 0, initial value, state[t, ...])`. Two TE attributes mark it: MEMBER (the recurrence's
name) on every TE of the step, STATE (the state placeholder) on each TE whose output the state carries.
The analysis sees an ordinary program (the state as an input); the passes never inline or combine members;
codegen/recurrence.py puts the members under one time loop and closes the back edge.
"""

from __future__ import annotations

from typing import Iterable

from tvm import te

MEMBER = "souffle.recurrence"
STATE = "souffle.state"

# Marks a pass leaves on a TE for the schedules (as block annotations once merged); the pass that sets each
# says what it means
GATE_BLOCKS = "souffle.gate_blocks"   # on a gate projection: its last axis is this many blocks of units
GATE_CELL = "souffle.gate_cell"       # on a cell update reading each of its units' gates
BF16_GEMM = "souffle_bf16_gemm"       # the packed panel's width of a GEMM on vdpbf16ps (te_passes/precision.py)
REDUCED_GEMM = "souffle_reduced_gemm"  # a GEMM reading native reduced operands (CUDA): their dtype
# on a copy of a map into the layout an instruction reads (vpdpbusd's channel quads, te_passes/int8_conv_vnni.py),
# made before the SOUFFLE transformations: the vertical pass keeps it (composed into its reader, a plain
# relayout of uint8 values, it left the convolution reading channels H x W apart) and composes no
# arithmetic into it (a producer's requantization unrolled in the transpose ran at a fifth of its speed;
# apart, it runs in the producer's write-back or a vectorized pass of its own)
LAYOUT_COPY = "souffle.layout_copy"


def member_of(op: te.Operation) -> str | None:
    """The name of the recurrence `op` is a step TE of, or None."""
    attrs = getattr(op, "attrs", None)
    return str(attrs[MEMBER]) if attrs is not None and MEMBER in attrs else None


def state_of(op: te.Operation) -> te.Tensor | None:
    """The state placeholder that carries `op`'s output to the next time step, or None."""
    attrs = getattr(op, "attrs", None)
    return attrs[STATE] if attrs is not None and STATE in attrs else None


def without_marks(attrs) -> dict:
    """`attrs` without the recurrence marks (TVM's PrimFunc creation rejects a tensor among op attrs)."""
    return {key: value for key, value in (attrs or {}).items() if key not in (MEMBER, STATE)}


def recurrences(ops: Iterable[te.Operation]) -> dict[str, list[te.Operation]]:
    """Recurrence name -> its member TEs, in the order of `ops`."""
    found: dict[str, list[te.Operation]] = {}
    for op in ops:
        name = member_of(op)
        if name is not None:
            found.setdefault(name, []).append(op)
    return found
