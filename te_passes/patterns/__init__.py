"""The pattern library: what a TE computes (a convolution, a matrix product, a row reduction), recognised in
one place and returned with its operands, axes and layouts named, so that passes and rules ask for a
pattern instead of counting a read's indices. Each matcher returns a frozen dataclass, or None."""

from te_passes.patterns.base import (LAYOUT_RANKS, ProductReduction, has_rank, in_layout, indices, is_map,
                                     product_reduction, rank, single_reduction)
from te_passes.patterns.conv import Conv, PlainConv, Window, conv, conv2d, data_reads_output_channel, plain_conv
from te_passes.patterns.linear import MatMul, batch_matmul, gemm, matmul
from te_passes.patterns.reduce import RowReduce, row_reduce

__all__ = ["LAYOUT_RANKS", "ProductReduction", "has_rank", "in_layout", "indices", "is_map", "product_reduction",
           "rank", "single_reduction", "Conv", "PlainConv", "Window", "conv", "conv2d", "data_reads_output_channel",
           "plain_conv", "MatMul",
           "batch_matmul", "gemm", "matmul", "RowReduce", "row_reduce"]
