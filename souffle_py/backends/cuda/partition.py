"""The GPU partition (paper section 5.4, Algorithm 1): which TEs become tiled kernels of their own and which
run together as one grid-synchronized kernel, and why each kernel starts where it does.

Cuts fall only before compute-intensive TEs:
- legality: a large contraction (at least OWN_KERNEL_MFLOP) that grid.py cannot tile (a convolution, a
  GEMM whose shape does not divide into its tiles), or a large GEMM of float16 / bfloat16 operands (grid
  kernels tile GEMMs on CUDA cores; tensor_cores.py's kernel takes tensor cores), keeps a tiled dlight
  kernel, the element-wise TEs reading it as its epilogue; a recurrence is never cut;
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

from tvm import te

from souffle_py.backends.cuda.nest import K_TILE, TILE
from souffle_py.backends.cuda.occupancy import resident_blocks
from souffle_py.backends.cuda.tensor_cores import on_tensor_cores
from souffle_py.backends.cuda.split_k import OWN_KERNEL_MFLOP, contraction_mflop, tiles_in_grid
from souffle_py.partition import HardwareSpec, OccupancyPolicy
from souffle_py.ir.graph import tensor_key
from souffle_py.ir.marks import member_of, recurrences

MAX_GRID_STAGES = 64


@dataclass
class Group:
    kind: str            # "tiled": dlight kernel (+ epilogue); "grid": one grid-synchronized kernel
    ops: list
    reason: str
    resident: int = 0    # grid: resident blocks per SM at its stages' largest demand
    demands: list = field(default_factory=list)


def gpu_partition(program, spec: HardwareSpec, demand_of: Callable, in_grid: Callable = tiles_in_grid
                  ) -> list[Group]:
    """The kernels of `program` in order; `demand_of(op)` is an occupancy.Demand, `in_grid(op)` whether a
    grid kernel computes the contraction `op` on a schedule of its own (grid_stages.in_grid: GEMMs of
    whole tiles, convolutions and large GEMMs dlight's GEMM rule schedules)."""
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
        if not inside and mflop >= OWN_KERNEL_MFLOP and (on_tensor_cores(op) or not in_grid(op)):
            why = (f"a {mflop:.0f} MFLOP {on_tensor_cores(op)} GEMM keeps a tensor-core kernel of its own"
                   if on_tensor_cores(op) else f"a {mflop:.0f} MFLOP {_untiled(op)} keeps a tiled kernel of its own")
            current = Group("tiled", (_own_prologues(groups, op) if on_tensor_cores(op) else []) + [op],
                            f"cut before CI TE {op.name}: {why} (>= {OWN_KERNEL_MFLOP} MFLOP)")
            groups[:] = [g for g in groups if g.ops]
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


def _untiled(op) -> str:
    """What keeps a large contraction out of the grid kernels' schedules."""
    if len(op.reduce_axis) > 1:
        return "convolution that dlight's GEMM rule does not schedule as an implicit GEMM (grouped or depthwise)"
    *_, rows, cols = (int(d) for d in op.output(0).shape)
    return (f"contraction ({rows} x {cols} outputs, depth {int(op.reduce_axis[0].dom.extent)}) that neither "
            f"{TILE} x {TILE} x {K_TILE} tiles nor dlight's GEMM rule schedule")


def _own_prologues(groups: list[Group], op) -> list:
    """The conversions of model inputs that only `op` reads (te_passes/precision.py rounds an input to the
    GEMM's reduced type in a TE of its own: it has no producer to do it), taken from the end of the grid
    kernel before it: the tiled kernel computes them in its shared-memory loads instead of a kernel
    launching to convert."""
    taken = []
    while groups and groups[-1].kind == "grid" and groups[-1].ops:
        last = groups[-1].ops[-1]
        if (last.reduce_axis or member_of(last) is not None or last.num_outputs != 1
                or any(not isinstance(t.op, te.PlaceholderOp) for t in last.input_tensors)
                or [t.op for t in op.input_tensors].count(last) != 1 or _read_elsewhere(last, op, groups)):
            break
        taken.insert(0, groups[-1].ops.pop())
        groups[-1].demands.pop()
    return taken


def _read_elsewhere(producer, reader, groups) -> bool:
    return any(t.op.same_as(producer) for g in groups for other in g.ops if other is not reader
               for t in other.input_tensors)


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


def prologues_of(ops, program, consumers, in_grid: Callable = tiles_in_grid) -> set:
    """The element-wise TEs of `ops` whose only reader is a GEMM or convolution stage among them on a
    schedule of its own (`in_grid`), which computes them in its shared-memory loads (grid.inline_prologues):
    attention's softmax normalization before P.V, a convolution's padded input."""
    members, outputs = set(ops), {tensor_key(t) for t in program.outputs.values()}
    found = set()
    for op in ops:
        readers = consumers.get(op, [])
        if op.reduce_axis or member_of(op) is not None or len(readers) != 1 or readers[0] not in members \
                or any(tensor_key(op.output(i)) in outputs for i in range(op.num_outputs)):
            continue
        if in_grid(readers[0]) and member_of(readers[0]) is None:
            found.add(op)
    return found
