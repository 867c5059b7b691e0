"""The GPU's passes, in order: the SOUFFLE transformations, the precision policy (real float16/bfloat16
operands for the tensor cores), GEMV weights transposed, then for merged kernels the restructuring the grid
kernels need: stacked recurrences as one layer x time wavefront (its input projections moved into the
steps as GEMVs over transposed weights, each layer's gates one reduction a warp finishes before the unit's
cell update) and long reductions over few outputs split into partial and final ones (split_k.py)."""

from __future__ import annotations

from souffle_py.backends.cuda.split_k import split_for
from souffle_py.passes.folds import FOLDS
from souffle_py.passes.manager import Pass
from souffle_py.passes.transformations import TRANSFORMATIONS
from te_passes.conv_weights import block_conv_weights
from te_passes.gate_projections import combine_gate_projections, mark_gate_cells
from te_passes.layout import transpose_gemv_weights
from te_passes.precision import Native, reduce_precision
from te_passes.split_reduction import split_reductions
from te_passes.wavefront import wavefront

MAX_GEMV_ROWS = 16   # contractions with fewer rows (batch x sequence) read their constant weights transposed
# conv weights [F / B, C, *k, B] by the first B dividing F: the frontend's blocks before the layout was a pass
# (chosen for the CPU's vectors), kept so that the GPU's kernels stay as they were measured; no GPU here to
# measure another choice (the CUDA schedules read a conv's weight like any other operand)
CONV_WEIGHT_BLOCKS = (16, 8)


CUDA_PASSES = (
    *FOLDS,
    Pass("block_conv_weights", "layout", lambda p, c: block_conv_weights(p, CONV_WEIGHT_BLOCKS),
         provides=("layout:conv_weight_blocks",),
         doc="conv weights blocked by output channel as the CPU's (te_passes/conv_weights.py), before the "
             "SOUFFLE transformations, which join blocked weights"),
    *TRANSFORMATIONS,
    Pass("reduce_precision", "precision", lambda p, c: reduce_precision(p, c.precision, Native(c.precision)),
         when=lambda c: c.precision != "fp32", doc="fp16/bf16: GEMM and batch-matmul operands as real "
                                                   "float16/bfloat16 tensors (te_passes/precision.py)"),
    Pass("transpose_gemv_weights", "layout", lambda p, c: transpose_gemv_weights(p, MAX_GEMV_ROWS),
         doc="GEMV weights stored [N, K]: a warp per output reads one weight row with adjacent lanes"),
    Pass("wavefront", "restructure", lambda p, c: wavefront(p), merged_only=True,
         doc="stacked recurrences as one layer x time wavefront (te_passes/wavefront.py)"),
    Pass("transpose_step_gemv_weights", "restructure", lambda p, c: transpose_gemv_weights(p, MAX_GEMV_ROWS),
         merged_only=True,
         doc="the input projections the wavefront moved into its steps, as GEMVs"),
    Pass("combine_gate_projections", "horizontal", lambda p, c: combine_gate_projections(p), merged_only=True,
         doc="a step's input and recurrent projections as one reduction (te_passes/gate_projections.py)"),
    Pass("mark_gate_cells", "restructure", lambda p, c: mark_gate_cells(p), merged_only=True,
         doc="a warp computes a unit's gates before its cell update"),
    Pass("split_reductions", "restructure", lambda p, c: split_reductions(p, lambda op: split_for(op, c.backend.spec)),
         merged_only=True,
         doc="long reductions over few outputs as partial and final ones (split_k.py)"),
)
