"""The CPU's default schedule rules, in the order they are tried (dispatch.py).

The chain rules come first and take whole groups of blocks (on threaded blocks only); each other block
gets the first block rule that applies to it and accepts it. The order matters where two rules apply to
one block: the bf16 and int8 rules before the float32 ones (their blocks are reductions and convs by shape), the gate
projection before the GEMM rule and the cell update before the injective rule (each hands back a block it
cannot group).
"""

from __future__ import annotations

from souffle_py.schedule.rules.bf16_conv import Bf16Conv
from souffle_py.schedule.rules.bf16_gemm import Bf16Gemm
from souffle_py.schedule.rules.cell_update import CellUpdate
from souffle_py.schedule.rules.conv_tile import ConvTile
from souffle_py.schedule.rules.gate_projection import GateProjection
from souffle_py.schedule.rules.gemm_panel import GemmPanel
from souffle_py.schedule.rules.injective import Injective
from souffle_py.schedule.rules.layout_copy import LayoutCopy
from souffle_py.schedule.rules.padding import Padding
from souffle_py.schedule.rules.reduction import Reduction
from souffle_py.schedule.rules.row_chain import RowChain
from souffle_py.schedule.rules.softmax_gemm import SoftmaxGemmChain
from souffle_py.schedule.rules.vnni_conv import VnniConv
from souffle_py.schedule.rules.vnni_gemm import VnniGemm

CPU_CHAIN_RULES = (
    SoftmaxGemmChain(),   # attention's softmax under P.V's row tiles
    RowChain(),           # a large softmax or LayerNorm row by row
)

CPU_RULES = (
    Bf16Gemm(),
    Bf16Conv(),
    VnniGemm(),
    VnniConv(),
    LayoutCopy(),
    GateProjection(),
    GemmPanel(),
    ConvTile(),
    Reduction(),
    Padding(),
    CellUpdate(),
    Injective(),
)
