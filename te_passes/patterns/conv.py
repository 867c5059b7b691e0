"""Convolutions recognised once: the frontend's direct convolution and the forms the layout passes make of
it, with its operands, layouts, channels, groups and window named.

The frontend emits out[n, f, *o] = sum over (c, *r) of X[n, channel(f, c), *o * s + r * d] * W[f, c, *r] over
the ONNX weight layout (OIHW; `plain_conv`); the block_conv_weights pass (te_passes/conv_weights.py) stores W
blocked over output channels, W[f // B, c, *r, f % B], the form every later pass and rule matches (`conv`).
A blocked convolution TE is a reduction over the product of two reads, a map X and that weight. Its forms,
by layout of (data, weight):

- ("NCW", "OIWo"): a 1-D convolution, [N, C, W] map, [F / B, C / g, k, B] weight;
- ("NCHW", "OIHWo"): a 2-D convolution (dense, grouped or depthwise);
- ("NCHW", "GOIHWo"): horizontal.py's stacked convolutions, the branch the output's first axis;
- ("NCHWc", "OIHWo" / "GOIHWo"): the same over a map stored in channel blocks [N, C / b, H, W, b]
  (conv_layout.py, channel_blocks.py).

The output may itself be stored in blocks (five axes, channel_blocks.py); the output channel is the
variable of axis 1 in every form. Where a pass composes an elementwise producer into the data operand the
product reads more than two tensors and `conv` does not match (`conv_layout` handles that form itself).
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import te

from souffle_py.ir.exprs import substitute, uses
from souffle_py.ir.graph import tensor_loads
from te_passes.patterns.base import LAYOUT_RANKS, indices, is_map, product_reduction, rank
from souffle_py.ir.marks import member_of

FORMS = (("NCW", "OIWo"), ("NCHW", "OIHWo"), ("NCHW", "GOIHWo"), ("NCHWc", "OIHWo"), ("NCHWc", "GOIHWo"))
SPATIAL = {"OIWo": 1, "OIHWo": 2, "GOIHWo": 2}  # spatial dimensions of each weight layout


@dataclass(frozen=True)
class Window:
    """Per spatial dimension: the stride (index step per output position), the dilation (step per kernel
    tap) and the data index at the origin (minus the padding when the conv reads an unpadded map)."""

    strides: tuple
    dilations: tuple
    offsets: tuple


@dataclass(frozen=True)
class Conv:
    """A convolution TE (module docstring): its data and weight reads and their layouts."""

    op: te.ComputeOp
    data: object  # the read of the map
    weight: object  # the read of the blocked weight
    layout: str  # the data's layout: NCW, NCHW or NCHWc
    weight_layout: str  # OIWo, OIHWo or GOIHWo

    @property
    def data_tensor(self) -> te.Tensor:
        return self.data.args[0]

    @property
    def weight_tensor(self) -> te.Tensor:
        return self.weight.args[0]

    @property
    def spatial(self) -> int:
        return SPATIAL[self.weight_layout]

    @property
    def stacked(self) -> bool:
        """Whether the weight stacks branches (horizontal.py) on a leading axis."""
        return self.weight_layout == "GOIHWo"

    @property
    def block(self) -> int:
        """Output channels per weight block (B)."""
        return int(self.weight_tensor.shape[-1])

    @property
    def filters(self) -> int:
        """Output channels per branch: weight blocks times the block."""
        return int(self.weight_tensor.shape[-(self.spatial + 3)]) * self.block

    @property
    def group_channels(self) -> int:
        """Input channels each output channel reduces over (C / groups)."""
        return int(self.weight_tensor.shape[-(self.spatial + 2)])

    @property
    def kernel(self) -> tuple:
        return tuple(int(d) for d in self.weight_tensor.shape[-(self.spatial + 1):-1])

    @property
    def channels(self) -> int:
        """Input channels of the map (in blocks: blocks times the block)."""
        shape = self.data_tensor.shape
        return int(shape[1]) * (int(shape[-1]) if self.layout == "NCHWc" else 1)

    @property
    def groups(self) -> int:
        return self.channels // self.group_channels

    @property
    def depthwise(self) -> bool:
        return self.group_channels == 1 and self.channels == self.filters

    @property
    def output_channel(self):
        """The output-channel variable (axis 1 in every form)."""
        return self.op.axis[1].var

    def reads_filter_blocks(self) -> bool:
        """Whether the weight is read W[.., f // B, .., f % B] at the output channel f (not, say, a bf16
        GEMM's packed weight, which has as many axes)."""
        first = indices(self.weight)[1 if self.stacked else 0]
        offset = tvm.sym.Analyzer().simplify(first * self.block + indices(self.weight)[-1] - self.output_channel)
        return isinstance(offset, tvm.tirx.IntImm) and offset.value == 0

    def window(self) -> Window | None:
        """Strides, dilations and origin offsets read off the data read's spatial indices (each an affine
        function of its output position and kernel tap); None where one is not."""
        outputs = [iv.var for iv in self.op.axis[2:2 + self.spatial]]
        taps = indices(self.weight)[-(self.spatial + 1):-1]
        spatial = indices(self.data)[2:2 + self.spatial]
        if len(outputs) != self.spatial or not all(isinstance(t, tvm.tirx.Var) for t in taps):
            return None
        zero = {v.__chandle__(): tvm.tirx.IntImm("int32", 0)
                for v in [*(iv.var for iv in self.op.axis), *(iv.var for iv in self.op.reduce_axis)]}
        analyzer = tvm.sym.Analyzer()
        found = []
        for index, out, tap in zip(spatial, outputs, taps):
            origin = analyzer.simplify(substitute(index, zero))
            steps = [analyzer.simplify(substitute(index, {**zero, v.__chandle__(): tvm.tirx.IntImm("int32", 1)})
                                       - origin) for v in (out, tap)]
            if not all(isinstance(x, tvm.tirx.IntImm) for x in (origin, *steps)):
                return None
            found.append((steps[0].value, steps[1].value, origin.value))
        strides, dilations, offsets = zip(*found)
        return Window(strides, dilations, offsets)


def conv(op) -> Conv | None:
    """`op` as a convolution of one of FORMS (module docstring); None when it is not one."""
    product = product_reduction(op)
    if product is None or len(product.loads) != 2:
        return None
    first, second = product.loads
    for layout, weight_layout in FORMS:
        ranks = (LAYOUT_RANKS[layout], LAYOUT_RANKS[weight_layout])
        if ranks[0] == ranks[1]:
            pair = _blocked_pair(product) if rank(first) == rank(second) == ranks[0] else None
            if pair is not None:
                return Conv(op, *pair, layout, weight_layout)
        elif (rank(first), rank(second)) == ranks:
            return Conv(op, first, second, layout, weight_layout)
        elif (rank(second), rank(first)) == ranks:
            return Conv(op, second, first, layout, weight_layout)
    return None


def _blocked_pair(product):
    """(data read, weight read) of a product of two reads of the same rank (a map in channel blocks and a
    blocked weight): the weight's first index is its block of output channels, the map's its batch; where
    that does not tell them apart (one block of filters), the data is the first factor, as the frontend
    writes it."""
    channel = product.op.axis[1].var
    first, second = product.loads
    by_channel = [uses(indices(ld)[0], channel) for ld in (first, second)]
    if by_channel == [False, True]:
        return first, second
    if by_channel == [True, False]:
        return second, first
    a_loads, b_loads = tensor_loads(product.a), tensor_loads(product.b)
    return (a_loads[0], b_loads[0]) if len(a_loads) == 1 and len(b_loads) == 1 else None


@dataclass(frozen=True)
class PlainConv:
    """A convolution as the frontend emits it (module docstring): the weight read W[f, c, *r] at the output
    channel f and the reduction's axes in order, the data a map of the same rank read at the batch n."""

    op: te.ComputeOp
    data: object
    weight: object

    @property
    def weight_tensor(self) -> te.Tensor:
        return self.weight.args[0]

    @property
    def filters(self) -> int:
        return int(self.weight_tensor.shape[0])


def plain_conv(op) -> PlainConv | None:
    """`op` as the frontend's convolution over an OIHW (OIW, OIDHW) weight; None when it is not one."""
    product = product_reduction(op)
    if product is None or len(product.loads) != 2 or len(op.axis) < 3:
        return None
    dims = len(op.axis)
    channel, batch = op.axis[1].var, op.axis[0].var
    reduced = [iv.var for iv in op.reduce_axis]
    for data, weight in (product.loads, product.loads[::-1]):
        w, x = indices(weight), indices(data)
        if rank(weight) != dims or rank(data) != dims or len(reduced) != dims - 1:
            continue
        if all(isinstance(i, tvm.tirx.Var) and i.same_as(v) for i, v in zip(w, [channel, *reduced])) \
                and isinstance(x[0], tvm.tirx.Var) and x[0].same_as(batch):
            return PlainConv(op, data, weight)
    return None


def conv2d(op) -> Conv | None:
    """`op` as block_conv_weights leaves the frontend's 2-D convolution: an NCHW output outside recurrences
    reading an NCHW map and an unstacked OIHWo weight (dense, grouped or depthwise); else None."""
    found = conv(op)
    if found is None or (found.layout, found.weight_layout) != ("NCHW", "OIHWo") or not is_map(op, "NCHW"):
        return None
    return found if member_of(op) is None else None


def data_reads_output_channel(found: Conv) -> bool:
    """Whether some data index depends on the output channel (a grouped or depthwise convolution)."""
    return any(uses(index, found.output_channel) for index in indices(found.data))
