"""Byte thresholds of the CPU rules that were measured, not derived: each is a value that won on the machines
named, not a size of the target's caches (cpu_target.CpuTarget has those), so it stays a number, here, with
what it was measured on. A rule imports its threshold by name (tests may patch the rule module's copy).

Register and lane budgets are not here: they are counts of the target's vector registers and lanes
(schedule/budgets.py, the conv rule's budgets in conv.py).
"""

from __future__ import annotations

KiB, MiB = 1 << 10, 1 << 20

# Weights per chunk kept in L2 (packed GEMM panels, a conv's output-channel blocks, the bf16 GEMM's panels):
# fitted on Zen 5 (1 MiB of L2 per core) and kept on the Emerald Rapids host (2 MiB): a quarter of the
# smaller L2, leaving room for the input rows and outputs the chunk's tiles also keep there.
L2_CHUNK_BYTES = 256 * KiB

# A streamed GEMM or conv chunk accumulates its output in L2 over the pieces only while that output is at
# most this (streaming.py): half of L2_CHUNK_BYTES, measured with it.
STREAM_OUTPUT_BYTES = 128 * KiB

# Row chains (row_chains.py) only where the epilogue's data is beyond a core's L2: 4 MiB, above Zen 5's 1 MiB
# and this host's 2 MiB (BERT's 12 x 128 x 128 scores, 786 KB, ran faster as separate blocks).
ROW_CHAIN_MIN_BYTES = 4 * MiB

# Pads written by their producer's tiles only from this size (padded_write_back.py): MNASNet's depthwise
# convs over 28 x 28 and 14 x 14 lost what their pads saved (0.01-0.02 ms), over 112 x 112 and 56 x 56 the
# pads' 0.03-0.17 ms outweighed it (Zen 5).
MIN_PADDED_BYTES = 1 * MiB

# A conv's weights, not streamed, are cut into chunks of output channels only from this size: smaller ones
# stay in L2 whole (a GoogLeNet stage: 3.45 ms in chunks, 2.11 whole; SqueezeNet 0.95x, DenseNet-121 0.96x,
# GoogLeNet 0.98x with fresh databases).
CHUNK_MIN_WEIGHT_BYTES = 1 * MiB

TABLE = {name: value for name, value in dict(globals()).items() if name.isupper() and name not in ("KiB", "MiB")}
