"""The GPU partition (paper section 5.4, Algorithm 1): which TEs become tiled kernels of their own and which
run together as one grid-synchronized kernel, and why each kernel starts where it does.

Cuts fall only before compute-intensive TEs:
- legality: a large contraction (at least OWN_KERNEL_MFLOP) that grid.py cannot tile (a convolution, a
  GEMM whose shape does not divide into its tiles) keeps a tiled dlight kernel, the element-wise TEs
  reading it as its epilogue; a recurrence is never cut;
- occupancy (profitability): a contraction whose per-block demand (registers, shared memory: ptxas's
  figures of its schedule, occupancy.py) would shrink the grid kernel's wave below the blocks a round of
  its stages already takes starts a new grid kernel (partition.OccupancyPolicy with grid-stride stages);
- compile time: at most MAX_GRID_STAGES TEs per grid kernel (TVM's lowering time grows quadratically with
  the stages of one function).
Every cut's reason names the numbers that forced it; each grid kernel records the resident blocks per SM
its largest demand allows (the grid is one wave of them). `prologues_of` names the element-wise TEs of a
grid kernel that its GEMMs compute in their loads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from souffle_py.backends.cuda.occupancy import resident_blocks
from souffle_py.backends.cuda.split_k import OWN_KERNEL_MFLOP, contraction_mflop, tiles_in_grid
from souffle_py.partition import HardwareSpec, OccupancyPolicy
from te_passes.graph import tensor_key
from te_passes.recurrence import member_of, recurrences

MAX_GRID_STAGES = 64


@dataclass
class Group:
    kind: str            # "tiled": dlight kernel (+ epilogue); "grid": one grid-synchronized kernel
    ops: list
    reason: str
    resident: int = 0    # grid: resident blocks per SM at its stages' largest demand
    demands: list = field(default_factory=list)


def gpu_partition(program, spec: HardwareSpec, demand_of: Callable) -> list[Group]:
    """The kernels of `program` in order; `demand_of(op)` is an occupancy.Demand."""
    policy = OccupancyPolicy(spec, launch_of=lambda op: demand_of(op).launch, grid_stride=True)
    groups: list[Group] = []
    open_recurrences: dict[str, int] = {}
    remaining = {name: len(members) for name, members in recurrences(program.stages).items()}
    current: Group | None = None
    for op in program.stages:
        recurrence = member_of(op)
        if recurrence is not None:
            open_recurrences[recurrence] = open_recurrences.get(recurrence, remaining[recurrence]) - 1
        inside = recurrence is not None or any(n > 0 for n in open_recurrences.values())
        mflop = contraction_mflop(op)
        if not inside and mflop >= OWN_KERNEL_MFLOP and not tiles_in_grid(op):
            current = Group("tiled", [op], f"cut before CI TE {op.name}: a {mflop:.0f} MFLOP contraction "
                                            f"keeps a tiled kernel of its own (>= {OWN_KERNEL_MFLOP} MFLOP)")
            groups.append(current)
            continue
        if current is not None and current.kind == "tiled" and not op.reduce_axis \
                and any(t.op in current.ops for t in op.input_tensors):
            current.ops.append(op)  # its epilogue
            continue
        reason, admitted = None, False
        if current is not None and current.kind == "grid" and not inside and mflop > 0:
            cut = policy.admit(op)  # adds `op` to the kernel when it does not cut
            reason, admitted = (f"cut before CI TE {op.name}: {cut}", False) if cut else (None, True)
        if reason is None and (current is None or current.kind != "grid"
                               or (len(current.ops) >= MAX_GRID_STAGES and not inside)):
            reason = ("program start" if not groups else f"after tiled kernel {groups[-1].ops[0].name}"
                      if current is not None and current.kind == "tiled" else
                      f"stage limit: {MAX_GRID_STAGES} TEs per grid kernel")
        if reason is not None:
            current = Group("grid", [], reason)
            groups.append(current)
            policy.reset()
        current.ops.append(op)
        current.demands.append(demand_of(op))
        if not admitted:
            policy.add(op)
    for group in groups:
        if group.kind == "grid":
            group.resident = resident_blocks(group.demands, spec)
    return groups


def unsynced(ops) -> list[list]:
    """A grid kernel's TEs as separate launches; a recurrence's members stay together (one time loop)."""
    parts: list[list] = []
    for op in ops:
        recurrence = member_of(op)
        if recurrence is not None and parts and member_of(parts[-1][0]) == recurrence:
            parts[-1].append(op)
        else:
            parts.append([op])
    return parts


def prologues_of(ops, program, consumers) -> set:
    """The element-wise TEs of `ops` whose only reader is a GEMM stage among them (which computes them in
    its shared-memory loads: grid.inline_prologues): attention's softmax normalization before P.V."""
    members, outputs = set(ops), {tensor_key(t) for t in program.outputs.values()}
    found = set()
    for op in ops:
        readers = consumers.get(op, [])
        if op.reduce_axis or member_of(op) is not None or len(readers) != 1 or readers[0] not in members \
                or any(tensor_key(op.output(i)) in outputs for i in range(op.num_outputs)):
            continue
        if tiles_in_grid(readers[0]) and member_of(readers[0]) is None:
            found.add(op)
    return found
