"""Depthwise convolution outputs stored in channel blocks, with the elementwise TEs after them (CPU backend).

A depthwise convolution over a channel-blocked input (conv_layout.py) computes a register tile of 16
channels by a row of output columns. Stored as NCHW, that tile is transposed into the output element by
element; stored as [N, C / 16, H, W, 16] it is written as whole vectors (EfficientNet-b0's 672-channel
5x5 depthwise conv at 14 x 14: 0.115 -> 0.085 ms). The elementwise TEs reading it one-to-one (batch norm
and SiLU, the squeeze-excite scale) are stored in the same blocks, which also vectorizes them over 16
channels where NCHW rows of 14 or 7 columns have no vector at all. Readers outside the chain (the
squeeze-excite pool, the project conv, which broadcasts its input anyway) read Tb[n, c // 16, y, x, c % 16].
A dense convolution read only by global pools (EfficientNet's head conv; BN + SiLU composed into the
pool) stores its weight's blocks the same way: its tile is written as whole vectors and the pool reduces
one channel per vector lane (7 x 7 rows have no vector of their own: 0.22 -> 0.03 ms).
Values are unchanged. Runs after channel_blocks.py, for depthwise convs outside its networks.
"""

from __future__ import annotations

import logging

from tvm import te

from souffle_py.ir.program import TEProgram
from te_passes.channel_blocks import in_blocks
from souffle_py.ir.graph import sweep, tensor_loads
from te_passes.patterns import conv, conv2d, has_rank, is_map
from souffle_py.ir.marks import member_of

log = logging.getLogger(__name__)


def block_depthwise_outputs(program: TEProgram, block: int) -> TEProgram:
    """`program` with each depthwise convolution over channel-blocked input (C a multiple of `block`)
    storing [N, C / block, H, W, block], and so the elementwise TEs that read it (transitively) one-to-one
    and read no other full-size map."""
    outputs = {t.op for t in program.outputs.values()}
    consumers = program.consumers()
    block_of: dict = {}  # chain member -> its channel block
    for op in program.stages:
        root = block if _is_blocked_depthwise(op, block) else _pooled_conv_block(op, consumers, block)
        if root and op not in outputs:
            block_of.update({member: root for member in _chain(op, consumers, outputs)})
    if not block_of:
        return program
    chain = set(block_of)
    def rewrite(op, reads):
        if op not in chain:
            return None
        b = block_of[op]
        new = in_blocks(op, b, reads)
        return new.op, lambda n, c, y, x, t=new, b=b: t[n, c // b, y, x, c % b]

    new_of, _ = sweep(program.stages, rewrite)
    log.info("%d conv chains store channel blocks (%d TEs)", sum(1 for op in chain if op.reduce_axis), len(chain))
    return program.rebuilt(new_of)


def _is_blocked_depthwise(op, block: int) -> bool:
    """A 2-D convolution whose data and weight reads are both channel-blocked (5-D), C a multiple of block."""
    found = conv(op)
    if (found is None or (found.layout, found.weight_layout) != ("NCHWc", "OIHWo") or not is_map(op)
            or member_of(op) is not None or str(op.output(0).dtype) != "float32"):
        return False
    return int(op.output(0).shape[1]) % block == 0 and int(op.output(0).shape[0]) == 1


def _pooled_conv_block(op, consumers, block: int) -> int | None:
    """The weight's channel block b (a multiple of `block`) when `op` is a dense convolution read only by
    reductions over its whole map (EfficientNet's head conv, read by the global pool with BN + SiLU
    composed in): stored as [N, F / b, H, W, b] its tile is written as whole vectors and the pool reduces
    one channel per lane (schedule/default.py); else None."""
    found = conv2d(op)
    if found is None or int(op.output(0).shape[0]) != 1 or not isinstance(found.weight_tensor.op, te.PlaceholderOp):
        return None
    b, shape = found.block, [int(d) for d in op.output(0).shape]
    readers = consumers.get(op, [])
    pooled = all(isinstance(r, te.ComputeOp) and r.reduce_axis and [int(d) for d in r.output(0).shape[2:]] == [1, 1]
                 for r in readers)
    return b if readers and pooled and b % block == 0 and shape[1] % b == 0 and shape[2:] != [1, 1] else None


def _chain(conv, consumers, outputs) -> set:
    """The conv and the elementwise TEs reading chain members one-to-one, each of whose full-size reads
    is of a chain member (a residual input would be gathered across blocks)."""
    shape = [int(d) for d in conv.output(0).shape]
    chain, frontier = {conv}, [conv]
    while frontier:
        op = frontier.pop()
        for reader in consumers.get(op, []):
            if reader in chain or reader in outputs or not _elementwise_over(reader, shape):
                continue
            if all(ld.args[0].op in chain or not _full_size(ld.args[0], shape) for ld in tensor_loads(reader.body[0])):
                chain.add(reader)
                frontier.append(reader)
    return chain


def _elementwise_over(op, shape) -> bool:
    return (isinstance(op, te.ComputeOp) and not op.reduce_axis and op.num_outputs == 1 and member_of(op) is None
            and [int(d) for d in op.output(0).shape] == shape)


def _full_size(t: te.Tensor, shape) -> bool:
    return has_rank(t, "NCHW") and [int(d) for d in t.shape[2:]] == shape[2:] and shape[2:] != [1, 1]
