"""The function-level passes that complete a default schedule: its marks (epilogues computed in
write-backs, ragged predicates, last tiles apart, weight prefetches) turned into code, and pads stored by the
write-back of the map they pad. Applied both where a model's kernels are built (default.py) and where a
schedule is measured (tuning.py's builder), so that a measured variant is the code that runs: measured
without them, a 3x3 conv's masked ragged tile kept its predicate in every tile and timed 1.54 ms against
1.00 ms as built, and variants.py chose a slower rival."""

from __future__ import annotations

from tvm import tirx

from souffle_py.schedule.epilogue import inline_tile_epilogues
from souffle_py.schedule.flat import restore_ragged_predicates
from souffle_py.schedule.padded_write_back import store_pads_in_write_backs
from souffle_py.schedule.ragged import last_tiles_apart
from souffle_py.schedule.streaming import inject_weight_prefetch


def finish_schedule(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` (scheduled) with its schedule marks lowered; unchanged where it has none."""
    return inject_weight_prefetch(last_tiles_apart(restore_ragged_predicates(
        store_pads_in_write_backs(inline_tile_epilogues(func)))))
