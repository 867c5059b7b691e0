"""An elementwise reader computed in a GEMM's or a convolution's tile write-back (CPU default rules)."""

from __future__ import annotations

import logging

from souffle_py.schedule.blocks import block_kind, calls_function, conjuncts_kept, realize_predicate

log = logging.getLogger(__name__)


def fuse_elementwise_epilogue(sch, write_back) -> None:
    """Compute the elementwise block that alone reads a convolution's or a GEMM's output (batch norm + ReLU,
    a residual add, a bias add) in its write-back of each register tile, while the tile is in registers:
    one pass over the map and one intermediate map fewer (ONNX Runtime's fused Conv + Add + ReLU). Left
    alone when the output has other readers or is the function's output, which TVM's reverse_compute_inline
    refuses, and when the block calls a function (EfficientNet's SiLU), which costs the conv's write-back
    more than its own vectorized pass does (EfficientNet-b0 ~2% slower with it fused)."""
    readers = sch.get_consumers(write_back)
    if len(readers) != 1 or block_kind(sch, readers[0]) != "injective" or calls_function(sch.get(readers[0]).body):
        return
    # TVM's reverse_compute_inline gives the write-back the reader's predicate in place of its own: a
    # masked tile's write-back with a reader outside the channel blocks (c < C) then stored past its row.
    # A masked write-back is inlined on a copy first (the copy's queries stay out of this schedule's trace).
    before = realize_predicate(sch, write_back)
    if before is not None:
        name = sch.get(write_back).name_hint
        trial = sch.copy()
        try:
            trial.reverse_compute_inline(trial.get_sblock(sch.get(readers[0]).name_hint))
        except Exception as exc:  # tvm.s_tir.ScheduleError: checked before anything changes
            log.debug("conv epilogue not fused: %s", str(exc).splitlines()[0])
            return
        if not conjuncts_kept(realize_predicate(trial, trial.get_sblock(name)), before):
            log.debug("conv epilogue of %s not fused: its write-back would lose its predicate %s", name, before)
            return
    try:
        sch.reverse_compute_inline(readers[0])
    except Exception as exc:  # tvm.s_tir.ScheduleError: checked before anything changes
        log.debug("conv epilogue not fused: %s", str(exc).splitlines()[0])
