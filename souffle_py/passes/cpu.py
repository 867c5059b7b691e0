"""The CPU's passes, in order: the SOUFFLE transformations, then the precision policy and the layouts the
rule-based schedules expect (schedule/default.py, conv.py, gates.py), in the lanes and tiles of the
CpuTarget compiled for (the CPU backend's scope: cpu_target.using). Facts name what a later pass relies
on (the gate grouping reads the marks of mark_gate_cells); each layout pass finds its own pattern, so any
one can be switched off (tests/test_passes.py)."""

from __future__ import annotations

from souffle_py.passes.folds import FOLDS
from souffle_py.passes.manager import Pass
from souffle_py.passes.transformations import TRANSFORMATIONS
from souffle_py.schedule.blocks import vector_lanes
from souffle_py.schedule.budgets import gemm_tile_columns
from souffle_py.schedule.conv import conv_max_lanes, conv_weight_blocks
from souffle_py.schedule.gates import group_units
from souffle_py.schedule.int8_dot import dot4_lanes, saturation_allowed, split_weights
from te_passes.batch_lanes import batches_in_lanes
from te_passes.channel_blocks import block_conv_networks
from te_passes.constant_dequantize import fold_constant_dequantize
from te_passes.conv_weights import block_conv_weights
from te_passes.conv_layout import block_depthwise_inputs, pad_filters, separate_depthwise_operands, widen_weight_blocks
from te_passes.depthwise_blocks import block_depthwise_outputs
from te_passes.flat_reductions import split_flat_reductions
from te_passes.gate_projections import group_gate_projections, mark_gate_cells
from te_passes.gemm_columns import pad_gemm_columns
from te_passes.int8_add_ratio import quantize_sums_in_ratios
from te_passes.int8_fold import fold_requantize_dequantize
from te_passes.int8_pixel_epilogue import flat_padded_epilogues
from te_passes.integer_kernels import integer_kernels
from te_passes.layout import pack_weights, transpose_operands
from te_passes.precision import reduce_precision
from te_passes.precision_conv import reduce_conv_precision
from te_passes.small_groups import densify_small_groups
from te_passes.squeeze_excite import fold_channel_scales
from te_passes.subnormals import flush_subnormal_params
from te_passes.unit_rows import lift_1d_convs


def _bf16(context) -> bool:
    return context.precision == "bf16"


BLOCKS = ("layout:conv_weight_blocks",)  # what the conv layout passes match: weights blocked by output channel
BLOCK_CONV_WEIGHTS = Pass(
    "block_conv_weights", "layout", lambda p, c: block_conv_weights(p, conv_weight_blocks()), provides=BLOCKS,
    doc="conv weights [F / B, C, *k, B], B a vector of the target's or half of one (te_passes/conv_weights.py); "
        "before the SOUFFLE transformations, which join blocked weights (te_passes/weight_blocks.py)")


CPU_PASSES = (
    *FOLDS,
    # first: every parameter a later pass derives (blocked, packed, folded weights) is derived from these
    Pass("flush_subnormal_params", "precision", lambda p, c: flush_subnormal_params(p),
         doc="float constants' subnormals made zero: an FMA with one takes a microcode assist on x86 "
             "(te_passes/subnormals.py)"),
    BLOCK_CONV_WEIGHTS,
    # int8: GEMMs of dequantized operands (QDQ models) as integer GEMMs, before any pass restructures them;
    # its convs read the blocked weight
    Pass("integer_kernels", "precision",
         lambda p, c: integer_kernels(p, dot4_lanes(), split_weights(), saturation_allowed),
         doc="QDQ GEMMs and convs in int8 x int8 -> int32 (te_passes/integer_kernels.py)"),
    Pass("fold_constant_dequantize", "precision", lambda p, c: fold_constant_dequantize(p),
         doc="a dequantized constant no integer kernel took (an int8 bias of its own scale) as its float32 "
             "values (te_passes/constant_dequantize.py)"),
    *TRANSFORMATIONS,
    Pass("fold_requantize_dequantize", "precision", lambda p, c: fold_requantize_dequantize(p),
         doc="a quantize-dequantize pair the vertical pass composed, as the float it stands for "
             "(te_passes/int8_fold.py)"),
    Pass("quantize_sums_in_ratios", "precision", lambda p, c: quantize_sums_in_ratios(p),
         doc="a residual add's quantization in scale ratios, as ONNX Runtime's QLinearAdd, not a division "
             "(te_passes/int8_add_ratio.py)"),
    Pass("flat_padded_epilogues", "layout", lambda p, c: flat_padded_epilogues(p),
         doc="the elementwise reader of a pixel-lane conv's padded sum over the padded pixels, computed in "
             "the conv's write-back (te_passes/int8_pixel_epilogue.py)"),
    # bf16: GEMM operands in bfloat16 for vdpbf16ps; the convolutions' follow once their layouts are chosen
    Pass("reduce_precision", "precision", lambda p, c: reduce_precision(p, c.precision),
         when=lambda c: c.precision != "fp32", provides=("precision:reduced",),
         doc="bf16: constant-weight GEMM operands in bfloat16 (te_passes/precision.py)"),
    Pass("lift_1d_convs", "layout", lambda p, c: lift_1d_convs(p),
         requires=BLOCKS,
         doc="1-D conv networks as 2-D ones over one row, for the layouts below"),
    Pass("split_flat_reductions", "layout", lambda p, c: split_flat_reductions(p),
         doc="sums over reshaped maps over their factors (GroupNorm(1))"),
    Pass("pad_gemm_columns", "layout", lambda p, c: pad_gemm_columns(p, gemm_tile_columns()),
         doc="ragged GEMM columns as whole panels (gemm_columns.py)"),
    Pass("pack_weights", "layout", lambda p, c: pack_weights(p, gemm_tile_columns()), provides=("layout:gemm_panels",),
         doc="the default GEMM's weight layout (te_passes/layout.py)"),
    Pass("transpose_operands", "layout", lambda p, c: transpose_operands(p),
         doc="computed GEMM operands read across columns (Q.K^T)"),
    Pass("batches_in_lanes", "layout", lambda p, c: batches_in_lanes(p, vector_lanes()),
         doc="attention over 7 x 7 windows: pairs in lanes"),
    Pass("mark_gate_cells", "layout", lambda p, c: mark_gate_cells(p), provides=("marks:gate_cells",),
         doc="an LSTM step's gate cells marked for the gate grouping"),
    Pass("group_gate_projections", "horizontal", lambda p, c: group_gate_projections(p, group_units),
         requires=("marks:gate_cells",), doc="an LSTM step by unit groups (gates.py's register tile)"),
    Pass("widen_weight_blocks", "layout", lambda p, c: widen_weight_blocks(p, conv_max_lanes()),
         requires=BLOCKS,
         doc="the dense conv's register tile (conv_layout.py)"),
    Pass("fold_channel_scales", "vertical", lambda p, c: fold_channel_scales(p),
         requires=BLOCKS,
         doc="squeeze-excite gates scale the project conv's weight instead"),
    Pass("densify_small_groups", "layout", lambda p, c: densify_small_groups(p, vector_lanes() // 4),
         requires=BLOCKS,
         doc="4-channel groups as dense 16-channel blocks"),
    Pass("block_conv_networks", "layout", lambda p, c: block_conv_networks(p, conv_max_lanes()),
         provides=("layout:nchwc",), requires=BLOCKS,
         doc="NCHWc maps from conv to conv, channels padded up to the block (channel_blocks.py)"),
    # depthwise convs left in NCHW (a reader outside the blocks): channel-blocked input and output, the
    # input a blocked padded copy where a pad and activation were composed into it
    Pass("separate_depthwise_operands", "layout", lambda p, c: separate_depthwise_operands(p),
         requires=BLOCKS,
         doc="a composed depthwise conv's padded input as a TE of its own (conv_layout.py)"),
    Pass("block_depthwise_inputs", "layout", lambda p, c: block_depthwise_inputs(p, vector_lanes()),
         requires=BLOCKS,
         doc="depthwise convs read channel-blocked input"),
    Pass("block_depthwise_outputs", "layout", lambda p, c: block_depthwise_outputs(p, vector_lanes()),
         requires=BLOCKS,
         doc="depthwise convs and their element-wise readers store channel blocks (depthwise_blocks.py)"),
    Pass("pad_filters", "layout", lambda p, c: pad_filters(p, conv_max_lanes(), vector_lanes()),
         requires=BLOCKS,
         doc="convs left in NCHW: whole vectors of filters"),
    Pass("reduce_conv_precision", "precision", lambda p, c: reduce_conv_precision(p), when=_bf16,
         requires=("precision:reduced", *BLOCKS), doc="the convolutions in their final layouts, on vdpbf16ps "
                                              "(precision_conv.py)"),
)
