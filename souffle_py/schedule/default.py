"""Rule-based default CPU schedules, applied to every sblock of a PrimFunc: the rules of rules/cpu.py, in
its order, through one dispatcher (rules/dispatch.py).

- Chains first: attention's softmax under its context GEMM's row tiles (rules/softmax_gemm.py), and a
  softmax or LayerNorm chain over more than 4 MB row by row under its epilogue's row loop
  (rules/row_chain.py).
- bf16 GEMMs and convs on vdpbf16ps micro-kernels (rules/bf16_gemm.py, rules/bf16_conv.py).
- GEMM-like (one reduction axis, two or more spatial axes, a product of two loads): register tiles
  accumulated in a local buffer, weight panels in L2-sized chunks, streamed where the rows are few
  (rules/gemm_panel.py); an LSTM step's gate projection and cell update by groups of units
  (rules/gate_projection.py, rules/cell_update.py).
- Convolution-like (several reduction axes, a product of two loads): a register tile over two spatial
  axes, one of them vectorized, accumulated in registers (rules/conv_tile.py).
- Other reductions (softmax/layernorm rows, means): parallel over the spatial axes, reduction innermost,
  in vector lanes (rules/reduction.py).
- Padding: rows in parallel, each row cut at the borders into plain loops (rules/padding.py).
- Injective (elementwise, broadcast, reshape, transpose...): all loops fused, parallel + vectorized
  (rules/injective.py).
- A model of little work, and a recurrence whose steps are, run on one thread (threads.py).
Untuned code is 50-100x slower than ONNX Runtime on BERT here, so even the default must be a real
schedule; tuned MetaSchedule records (tuning.py) replace these where the database has them.
"""

from __future__ import annotations

from tvm import s_tir, tirx

from souffle_py.schedule.blocks import leaf_blocks
from souffle_py.schedule.finish import finish_schedule
from souffle_py.schedule.rules.dispatch import apply_rules
from souffle_py.schedule.threads import one_parallel_region, serial_recurrences, time_loops_of


def schedule_cpu(func: tirx.PrimFunc, names=None, one_thread: bool = False) -> tirx.PrimFunc:
    """`func` with a default schedule on each of its sblocks, or on those named in `names` (the others are
    scheduled already); unchanged blocks where a rule does not fit. one_thread: no parallel loop at all
    (a model of little work, `runs_on_one_thread`)."""
    sch = s_tir.Schedule(func)
    serial_steps, serial_blocks = serial_recurrences(func)
    time_loops = time_loops_of(sch)  # before the rules, which leave them as they are
    apply_rules(sch, [sch.get(block).name_hint for block in leaf_blocks(sch)] if names is None else names,
                lambda name: one_thread or name in serial_blocks)
    for i, time_loop in enumerate(time_loops):
        if not one_thread and i not in serial_steps:
            one_parallel_region(sch, time_loop)
    return finish_schedule(sch.mod["main"])


def schedule_blocks(sch: s_tir.Schedule, names, one_thread: bool = False) -> None:
    """The default schedule on the sblocks named `names` of `sch` (the others stay as they are: a merged
    kernel's tuned stages, schedule/staged.py). Blocks are looked up by name and nothing else is, so the
    trace replays on any function with blocks of those names (a stage's default competes in tuning)."""
    _, serial_blocks = serial_recurrences(sch.mod["main"])
    apply_rules(sch, names, lambda name: one_thread or name in serial_blocks)
