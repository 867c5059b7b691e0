"""Which reductions of a grid kernel to split (te_passes/split_reduction.py), and into how many parts.

A grid kernel's stage is as fast as its slowest thread: a stage whose outputs fill fewer than half of
the GPU's SMs while each output reduces over a long axis leaves the rest of the grid idle until the
next barrier. Splitting it costs one more grid barrier (~1.1-1.7 us on an H100) and buys S times the
threads or tiles, so only long reductions on few SMs are split:
- a GEMM that the grid kernel tiles (64 x 64 output tiles), at least MIN_GEMM_SPLIT deep: into a power
  of two of contiguous depth chunks, until the tiles fill half the SMs, each chunk at least
  MIN_GEMM_DEPTH deep (BERT-base's second FFN GEMM: 24 tiles of depth 3072 -> 4 x 24 tiles of 768; a
  tile of depth 768 takes a few microseconds, about what the extra barrier and final sum cost, so its
  attention output GEMM stays whole);
- any other reduction of at least MIN_DEPTH terms per thread (a 256-term GEMV gains less than the barrier
  costs): interleaved into enough parts for one block of threads per SM, each at least MIN_CHUNK terms
  per thread. A reduction that grid.py gives a warp per output (layer-norm rows, GEMVs over weight rows)
  has 32 lanes per output already, so it splits only from 32 x MIN_DEPTH terms: BERT-base's 768-term
  layer-norm rows stay whole (24 terms per lane, no barrier), where one thread per row split them into
  24 parts of 32.
A recurrence's step TEs are not split (each split would add a barrier to every time step), nor are the
contractions that keep tiled kernels of their own.
"""

from __future__ import annotations

from math import prod

from souffle_py.backends.cuda.nest import K_TILE, THREADS, TILE, WARP
from souffle_py.backends.cuda.tensor_cores import on_tensor_cores
from souffle_py.backends.cuda.warps import warp_per_output
from souffle_py.partition import HardwareSpec
from souffle_py.ir.analysis.body import operations_per_point, reads
from souffle_py.ir.analysis.tensor_level import is_contraction
from souffle_py.ir.marks import member_of
from te_passes.split_reduction import Split

MIN_GEMM_SPLIT = 1024
MIN_GEMM_DEPTH = 256
MIN_DEPTH = 512
MIN_CHUNK = 32
OWN_KERNEL_MFLOP = 64   # contractions from this size keep dlight's tiled kernel (BERT-base's GEMMs: 151+)


def split_for(op, spec: HardwareSpec) -> Split | None:
    """The split of `op` inside a grid kernel on `spec`, or None to keep it whole."""
    if member_of(op) is not None:
        return None
    depth = int(op.reduce_axis[0].dom.extent)
    outputs = prod(int(d) for d in op.output(0).shape)
    if on_tensor_cores(op) and contraction_mflop(op) >= OWN_KERNEL_MFLOP:  # a tensor-core kernel of its own
        return None
    if tiles_in_grid(op):
        if depth < MIN_GEMM_SPLIT:
            return None
        tiles, parts = outputs // (TILE * TILE), 1
        while 2 * tiles * parts <= spec.sms and depth % (2 * parts * K_TILE) == 0 \
                and depth // (2 * parts) >= MIN_GEMM_DEPTH:
            parts *= 2
        return Split(parts, contiguous=True) if parts > 1 else None
    if contraction_mflop(op) >= OWN_KERNEL_MFLOP or depth < MIN_DEPTH:
        return None
    lanes = WARP if warp_per_output(op) else 1  # (builds the op's block: only for long reductions)
    per_block = THREADS // lanes
    if depth < MIN_DEPTH * lanes or 2 * -(-outputs // per_block) > spec.sms:
        return None
    parts = min(-(-spec.sms * per_block // outputs), depth // (MIN_CHUNK * lanes))
    return Split(parts) if parts > 1 else None


def tiles_in_grid(op) -> bool:
    """A GEMM whose rows, columns and reduction divide into grid.py's tiles: tiled inside a grid kernel."""
    shape = [int(d) for d in op.output(0).shape]
    return len(op.reduce_axis) == 1 and len(shape) >= 2 and shape[-2] % TILE == 0 and shape[-1] % TILE == 0 \
        and int(op.reduce_axis[0].dom.extent) % K_TILE == 0 and is_contraction(op, reads(op))


def contraction_mflop(op) -> float:
    """MFLOP of a GEMM/convolution-like TE (0 for anything else)."""
    if not op.reduce_axis or not is_contraction(op, reads(op)):
        return 0.0
    points = prod(int(iv.dom.extent) for iv in list(op.axis) + list(op.reduce_axis))
    return operations_per_point(op) * points / 1e6
