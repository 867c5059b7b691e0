"""The launch nest every stage of a grid-synchronized kernel shares (grid.py): blocks x WARPS warps of WARP
lanes, and the shared-memory tile of its GEMM stages."""

WARP = 32                 # lanes of a warp: threadIdx.x
THREADS = 256             # threads per block of a grid kernel
WARPS = THREADS // WARP   # warps per block: threadIdx.y
# A GEMM stage's tile: TILE x TILE outputs per block, each thread a MICRO x MICRO register tile, operands
# staged through shared memory K_TILE deep ((TILE / MICRO)^2 must be THREADS)
TILE, MICRO, K_TILE = 64, 4, 16
