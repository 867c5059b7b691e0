"""What each stage of a grid kernel demands of an SM, and how many blocks one wave of the kernel holds
(paper section 5.4, Algorithm 1, for kernels whose stages loop over their work).

A stage's demand is a LaunchConfig (partition.py): the blocks one round of it takes, the kernel's
THREADS threads, and its registers and shared memory per block.
- A GEMM stage (one that grid.py tiles) runs on its own schedule (transplant.py): its blocks are its
  64 x 64 tiles, and its registers and shared memory are what ptxas reports for that schedule compiled
  as a kernel of its own (all distinct GEMM stages of a program in one nvcc call; BERT-base has 5).
- Any other stage: a warp per output of a warp reduction, else a thread per ELEMENTS_PER_THREAD
  elements (partition.estimated_launch), at REGISTER_ESTIMATE registers and no shared memory (assumed:
  compiling every memory-intensive stage alone would cost more than it tells).

A kernel's resident blocks per SM are the occupancy formula's for the largest demand among its stages;
its grid is one wave of them, and its launch bounds make ptxas keep the kernel's registers within that
residency (nvcc.with_min_blocks), so the grid never has to be cut after compiling.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import tvm
from tvm import s_tir, te

from souffle_py.backends.cuda import nvcc
from souffle_py.backends.cuda.launches import launch_nests
from souffle_py.backends.cuda.nest import THREADS, TILE, WARPS
from souffle_py.backends.cuda.split_k import tiles_in_grid
from souffle_py.backends.cuda.transplant import dlight_stage_trace, selected_stages, tensor_core_stage_trace
from souffle_py.backends.cuda.warps import warp_per_output
from souffle_py.partition import HardwareSpec, LaunchConfig, max_active_blocks_per_sm
from souffle_py.structural import StructuralMap
from souffle_py.ir.graph import isolate
from souffle_py.ir.marks import member_of

REGISTER_ESTIMATE = 64      # registers per thread assumed for stages without ptxas figures
ELEMENTS_PER_THREAD = 4     # a memory-intensive stage's round: one thread per this many elements


@dataclass(frozen=True)
class Demand:
    """A stage's demand and where its figures come from ("ptxas, the stage alone" or "estimate")."""

    launch: LaunchConfig
    source: str


def stage_demands(ops, target, arch: str, select, in_grid=None) -> dict:
    """{op: Demand} for TEs of grid kernels; `in_grid(op)` (default: a GEMM of whole tiles) says which keep a
    schedule of their own inside the kernel (grid_stages.in_grid), and `select(sch, block)` picks their
    stages."""
    demands, gemms = {}, {}
    for op in ops:
        outputs = prod(int(d) for d in op.output(0).shape)
        if (in_grid(op) if in_grid is not None else tiles_in_grid(op) and member_of(op) is None):
            inputs, results = isolate(op)
            stages = selected_stages(te.create_prim_func([*inputs, *results]), select)
            if stages:
                gemms[op] = (stages[0].func, outputs // (TILE * TILE) if tiles_in_grid(op) else None)
                continue
        per_block = WARPS if op.reduce_axis and warp_per_output(op) else THREADS * ELEMENTS_PER_THREAD
        demands[op] = Demand(LaunchConfig(max(1, -(-outputs // per_block)), THREADS, REGISTER_ESTIMATE, 0),
                             "estimate")
    figures = _ptxas_figures([func for func, _ in gemms.values()], target, arch)
    for (op, (_, tiles)), (resources, blocks) in zip(gemms.items(), figures):
        tiles = tiles or blocks or 1  # a convolution's: the blocks of its implicit GEMM's schedule
        demands[op] = Demand(LaunchConfig(tiles, THREADS, REGISTER_ESTIMATE, 0), "estimate") if resources is None \
            else Demand(LaunchConfig(tiles, THREADS, resources.registers, resources.shared_bytes),
                        "ptxas, the stage alone")
    return demands


def resident_blocks(demands, spec: HardwareSpec) -> int:
    """Blocks per SM that a kernel of stages with `demands` keeps resident (0: it cannot run)."""
    return max_active_blocks_per_sm(spec, max(d.launch.threads_per_block for d in demands),
                                    max(d.launch.registers_per_thread for d in demands),
                                    max(d.launch.shared_memory_per_block for d in demands))


_FIGURES = StructuralMap()  # GEMM stage function (+ target, arch) -> (ptxas resources or None, blocks or None)


def _ptxas_figures(funcs, target, arch: str) -> list:
    """(ptxas's resources, the blocks of its launch) of each GEMM / convolution stage on its untuned
    schedule (wmma for float16 / bfloat16 operands, else dlight's), compiled alone (None where that
    fails); distinct stages compiled together once per process."""
    extra = (str(target), arch)
    missing, queued = {}, StructuralMap()
    for func in funcs:
        if not _FIGURES.has(func, extra) and not queued.has(func):
            queued.set(func, True)
            missing[f"stage{len(missing)}"] = func
    if missing:
        resources, blocks = _compile_alone(missing, target, arch)
        for name, func in missing.items():
            _FIGURES.set(func, (resources.get(f"{name}_kernel"), blocks.get(name)), extra)
    return [_FIGURES.get(func, extra) for func in funcs]


def _compile_alone(funcs: dict, target, arch: str) -> tuple[dict, dict]:
    """({device kernel: resources}, {name: blocks}) of the stages on their untuned schedules ({} where that
    fails)."""
    scheduled = {}
    for name, func in funcs.items():
        trace = tensor_core_stage_trace(func, target)[0] or dlight_stage_trace(func, target)
        if trace is None:
            continue
        sch = s_tir.Schedule(func)
        trace.apply_to_schedule(sch, remove_postproc=False)
        scheduled[name] = sch.mod["main"].with_attr("global_symbol", name)
    blocks = {name: nests[0].blocks for name, func in scheduled.items() for nests in [launch_nests(func)] if nests}
    try:
        source = nvcc.cuda_source(tvm.compile(tvm.IRModule(scheduled), target=target)) if scheduled else ""
        return (nvcc.compile_cuda(source, (arch,))[1].get(arch, {}) if source else {}), blocks
    except Exception:  # the figures are estimates then; the kernel's own build reports its errors
        return {}, blocks
