"""Thresholds of the CPU rules that were measured, not derived: byte sizes, gains, work minimums. Each is a
value that won on the machines named, not a size of the target's caches or registers (cpu_target.CpuTarget
has those), so it stays a number, here, with what it was measured on (tests/test_thresholds.py: every
rule's budget is here, in budgets.py or a count of the target's registers). A rule imports its threshold by
name (tests may patch the rule module's copy).

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

# Row chains (rules/row_chain.py) only where the epilogue's data is beyond a core's L2: 4 MiB, above Zen 5's 1 MiB
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

# blocks.py: below this many points a parallel launch costs more than it saves
PARALLEL_MIN = 4096

# rules/conv_tile.py: FMAs per load a filter set must gain over the one-block tile (16-channel blocks at
# 14 x 14 and 28 x 28, 2.25x: 1x1 0.06 -> 0.05 ms, 3x3 96 -> 96 at 28 x 28 1.0 -> 0.39)
FILTER_SET_GAIN = 1.25

# rules/conv_tile.py: this many times the FMAs per load of the best even tile (7 or 5 blocks of 32
# channels, 3x3 at 14 x 14 and 7x1 at 17 x 17: 1.28x, 0.311 -> 0.278 and 0.38 -> 0.355 ms; 9 blocks of a
# 1x1 conv at 28 x 28: 1.25x, 0.339 -> 0.354 ms)
UNEVEN_SET_GAIN = 1.27

# rules/conv_tile.py: a vector that must gather some operand element by element is worth less
GATHER_PENALTY = 4

# rules/gemm_panel.py: GEMMs of at most this many rows stream their weights (streaming.py): with its weights cold,
# BERT's 128 x 768 x 3072 2.31 -> 2.07 ms, 49 x 4096 x 1024 1.98 -> 1.77; Swin-B's 196 x 512 x 2048 1.50 ->
# 1.37 ms in a chain of 8 FFNs (1.34 with one set of weights for all 8: what is lost is the cold weights),
# Swin-B 146.8 -> 140.2 ms; Swin-T, ViT-B/16, DeiT-tiny (196/197 rows) within the noise (0.5-2.5% either way
# in alternated runs)
STREAM_GEMM_ROWS = 256

# ragged.py: a masked last tile is taken when the tiles then compute this much more per step
RAGGED_TILE_GAIN = 1.25

# streaming.py: chunks of output channels (or columns) in parallel: at least this many, each accumulating its
# output (in L2) over the pieces (STREAM_OUTPUT_BYTES)
STREAM_MIN_CHUNKS = 4

# streaming.py: reduction elements per piece (MLAS's 128 channels: 16 KB of a 32-lane block)
STREAM_PIECE = 128

# streaming.py: and the chunks shared among the threads this evenly (the busiest thread's share against an
# even one): Inception-v3's 160 -> 160 1x7 convs at 17 x 17 in 5 chunks, 3 on one thread and 2 on the other,
# ran 0.71 ms, not streamed 0.61
STREAM_BALANCE = 1.1

# threads.py: block iterations per step below which a recurrence runs on one thread
STEP_WORK_MIN = 65536

# threads.py: block iterations below which a whole model runs on one thread ...
MODEL_WORK_MIN = 1 << 22

# threads.py: ... if its buffers are smaller than this too (runs_on_one_thread)
MODEL_BYTES_MIN = 1 << 20

# flat.py: reduction rows shorter than this many vectors keep the row rule: their lanes' final horizontal sum
# costs what the masked vectors save (LayerNorm over 14)
RAGGED_MIN_VECTORS = 2

# Accumulators that cover vpdpbusd's latency in an int8 pixel-lane conv tile (int8_pixel_conv.tile_shape,
# which takes the fewest loads per instruction among tiles of at least this many): measured on the
# Emerald Rapids host, ResNet-50's 28 x 28 maps ran 1.1 ms of pixel convs in 2 x 7 tiles (14
# accumulators) against 1.5 ms in 16 x 1 (16, but a broadcast load per instruction).
PIXEL_TILE_ACCUMULATORS = 12

# The share of the target's L1d a pixel-lane tile's input panel may take (int8_pixel_conv.tile_shape): the
# panel is read again by every channel tile, beside their weights. Emerald Rapids (48 KiB): ResNet-50's
# 512-channel 28 x 28 convs, panels of 16 and 40 KiB 0.92 and 0.95 ms, of 56 KiB 1.35 ms.
PIXEL_PANEL_L1_SHARE = 0.75

TABLE = {name: value for name, value in dict(globals()).items() if name.isupper() and name not in ("KiB", "MiB")}
