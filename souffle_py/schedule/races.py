"""Detect data races that a schedule introduced: a block under a parallel loop that writes a buffer shared
by all threads (a function parameter or a root-level allocation) at elements that do not depend on the
parallel loop variable — every thread then writes the same elements (typically a producer computed
redundantly at a parallel consumer's loop by `compute_at`).

MetaSchedule measures candidates for speed, not correctness, and on multi-stage functions it can produce
exactly this; tuned schedules are checked before use (schedule/tuning.py).
"""

from __future__ import annotations

import tvm_ffi
from tvm import s_tir, tirx

from souffle_py.schedule.blocks import uses


def parallel_write_races(func: tirx.PrimFunc) -> list[str]:
    """Descriptions of the racy writes in `func` (empty when it has none)."""
    shared = {p.name for p in func.params}
    root = func.body.block if isinstance(func.body, s_tir.stmt.SBlockRealize) else None
    if root is not None:
        shared |= {b.name for b in root.alloc_buffers}
    races: list[str] = []

    def visit_loop(loop):
        if loop.kind != tirx.ForKind.PARALLEL or int(loop.extent) <= 1:
            return
        var = loop.loop_var

        def visit_block(realize):
            block = realize.block
            written = [r.source.name for r in block.writes if r.source.name in shared]
            if written and not any(uses(value, var) for value in realize.iter_values):
                races.append(f"block '{block.name_hint}' writes {written} from every iteration of parallel "
                             f"loop '{var.name}'")

        tvm_ffi.structural_walk(loop.body, [(s_tir.stmt.SBlockRealize, visit_block)])

    tvm_ffi.structural_walk(func.body, [(tirx.For, visit_loop)])
    return races
