"""Recurrences in a merged kernel: one time loop around their step TEs, then the back edge closed.

The frontend writes a recurrence as TEs over all T steps that read a state placeholder (state[t] stands
for source[t - 1], read only under `t != 0`; see souffle_py/ir/marks.py). Two steps:
- `roll_time_loops` (when the kernel is made) merges the members' outermost (time) loops into one serial
  loop, annotated TIME_LOOP so that the default schedules keep it serial and schedule the loops inside it;
- `close_back_edges` (after scheduling) rewrites every read state[t, ...] into source[t - 1, ...] and drops
  the state parameters. Before that the state is an ordinary input, so every block is complete and the
  scope a stage pipeline, which TVM's schedule primitives require.
Step t then reads what step t - 1 wrote, in the same kernel call, and the weights stay in cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import tvm
import tvm_ffi
from tvm import s_tir, tirx

TIME_LOOP = "souffle.time_loop"


@dataclass(frozen=True)
class Loop:
    """One recurrence in a kernel: its member blocks (program order) and state -> source buffer names."""

    blocks: tuple[str, ...]
    back_edges: tuple[tuple[str, str], ...]


def roll_time_loops(func: tirx.PrimFunc, loops: Sequence[Loop]) -> tirx.PrimFunc:
    """`func` with each recurrence's member blocks under one serial time loop."""
    if not loops:
        return func
    sch = s_tir.Schedule(func)
    for loop in loops:
        time_loops = [sch.get_loops(sch.get_sblock(name))[0] for name in loop.blocks]
        merged = sch.merge(*time_loops) if len(time_loops) > 1 else time_loops[0]
        sch.annotate(merged, TIME_LOOP, 1)
    return sch.mod["main"]


def close_back_edges(func: tirx.PrimFunc, loops: Sequence[Loop]) -> tirx.PrimFunc:
    """`func` (scheduled) reading each state from its source one step back; state parameters dropped."""
    if not loops:
        return func
    edges = {state: source for loop in loops for state, source in loop.back_edges}
    buffers = _buffers_by_name(func)
    state_buffers = {buffers[state]: buffers[source] for state, source in edges.items()}

    def previous_step(load):
        source = _lookup(state_buffers, load.source)
        if source is None:
            return load
        return tirx.BufferLoad(source, [load.indices[0] - 1, *load.indices[1:]])

    def whole_source(region):
        source = _lookup(state_buffers, region.source)
        if source is None:
            return region
        return tirx.BufferRegion(source, [tvm.ir.Range(0, extent) for extent in source.shape])

    body = tvm_ffi.structural_map(func.body, [(tvm.ir.expr.TensorLoad, previous_step),
                                              (tvm.ir.expr.TensorRegion, whole_source)])
    params = [p for p in func.params if _lookup(state_buffers, p) is None]
    return tirx.PrimFunc(params, body, func.ret_type, func.attrs)


def is_time_loop(sch: s_tir.Schedule, loop) -> bool:
    return TIME_LOOP in sch.get(loop).annotations


def _buffers_by_name(func: tirx.PrimFunc) -> dict:
    """Parameter and allocated buffers of `func` by name (merged kernels name them uniquely)."""
    found = {p.name: p for p in func.params}

    def visit(var):
        if type(var.ty).__name__ == "BufferType":
            found.setdefault(var.name, var)

    tvm_ffi.structural_walk(func.body, [(tvm.ir.expr.Var, visit)])
    return found


def _lookup(mapping: dict, buffer):
    return next((value for key, value in mapping.items() if key.same_as(buffer)), None)
