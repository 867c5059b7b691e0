"""Whether a compiled CUDA model can run on a GPU, checked without one: every kernel that grid-syncs is
launched cooperatively and its grid fits the GPU's occupancy at the registers and shared memory ptxas
reported.

A grid barrier (`cooperative_groups::this_grid().sync()`) in a kernel launched the ordinary way kills it
with cudaErrorLaunchFailure and poisons the process's CUDA context; a cooperative grid larger than the
GPU keeps resident fails with an empty error (../shared/gpu/README.md). Both are decided at compile
time, so both are checked here, on what a GPU machine loads: the device source (which kernels call the
barrier), the launch tags TVM serialized with the device module inside the exported library (what
TVM's CUDA runtime reads to choose cuLaunchCooperativeKernel), and the plan's launches.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

from souffle_py.backends.cuda.nvcc import _DEFINITION
from souffle_py.partition import HardwareSpec, max_active_blocks_per_sm

COOPERATIVE_TAG = "tirx.use_cooperative_launch"
_GRID_SYNC = re.compile(r"\btvm_builtin_cuda_grid_sync\(\)|this_grid\(\)\s*\.\s*sync\(\)")  # TVM's helper, or inline


def grid_sync_kernels(source: str) -> set[str]:
    """The `__global__` functions of `source` (CUDA C) that call a grid-wide barrier."""
    starts = [(m.start(), m.group(1)) for m in _DEFINITION.finditer(source)]
    found = set()
    for (start, name), (end, _) in zip(starts, starts[1:] + [(len(source), "")]):
        if _GRID_SYNC.search(source, start, end):
            found.add(name)
    return found


def launch_tags(library: bytes, kernels) -> dict[str, tuple[str, ...]]:
    """{kernel: its launch parameter tags} as serialized with the CUDA module in an exported library
    (TVM's FunctionInfo: name, argument types, launch parameter tags), for the kernels named; a kernel
    whose record is not found is left out."""
    tags = {}
    for kernel in kernels:
        name = kernel.encode()
        record = _string(name) + _string(name)  # the function map's key, then FunctionInfo's name
        at = library.find(record)
        if at < 0:
            continue
        try:
            at += len(record)
            (arg_count,) = struct.unpack_from("<Q", library, at)
            at += 8 + 4 * arg_count  # DLDataType: code, bits, lanes (u8, u8, u16)
            (tag_count,) = struct.unpack_from("<Q", library, at)
            at += 8
            found = []
            for _ in range(tag_count):
                (length,) = struct.unpack_from("<Q", library, at)
                found.append(library[at + 8:at + 8 + length].decode())
                at += 8 + length
        except (struct.error, UnicodeDecodeError):
            continue
        tags[kernel] = tuple(found)
    return tags


def _string(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


@dataclass(frozen=True)
class KernelReadiness:
    """One device kernel that grid-syncs: its launch and whether each GPU keeps its grid resident."""

    kernel: str
    blocks: int
    threads: int
    registers: int | None
    shared_bytes: int | None
    cooperative_tag: bool
    resident: dict          # GPU name -> blocks per SM its occupancy allows
    fits: dict              # GPU name -> whether blocks <= SMs x resident

    def problems(self) -> list[str]:
        found = []
        if not self.cooperative_tag:
            found.append(f"kernel {self.kernel} grid-syncs but its launch lacks the '{COOPERATIVE_TAG}' tag "
                         "(an ordinary launch dies at the barrier and poisons the CUDA context)")
        for gpu, fits in self.fits.items():
            if not fits:
                found.append(f"kernel {self.kernel}: a cooperative grid of {self.blocks} blocks x {self.threads} "
                             f"threads at {self.registers} registers and {self.shared_bytes} B shared memory "
                             f"keeps {self.resident[gpu]} blocks per SM resident on {gpu}: it does not fit")
        return found


def check_grids(plan, source: str, library: bytes, gpus: dict[str, HardwareSpec]) -> list[KernelReadiness]:
    """Every kernel that grid-syncs (by its source, and by the plan's cooperative launches): its tag in
    the exported `library` and its grid against the occupancy of each of `gpus` (name -> spec) at the
    registers and shared memory ptxas reported. A kernel the plan does not know is reported as unfit."""
    launches = {l.kernel: l for call in plan.calls for l in call.launches}
    syncing = grid_sync_kernels(source) | {k for k, l in launches.items() if l.cooperative or l.grid_syncs}
    tags = launch_tags(library, sorted(syncing))
    rows = []
    for kernel in sorted(syncing):
        launch = launches.get(kernel)
        resident, fits = {}, {}
        for gpu, spec in gpus.items():
            known = launch is not None and launch.registers is not None
            resident[gpu] = (max_active_blocks_per_sm(spec, launch.threads, launch.registers, launch.shared_bytes or 0)
                             if known else 0)
            fits[gpu] = known and launch.blocks <= spec.sms * resident[gpu]
        rows.append(KernelReadiness(kernel, launch.blocks if launch else 0, launch.threads if launch else 0,
                                    launch.registers if launch else None, launch.shared_bytes if launch else None,
                                    COOPERATIVE_TAG in tags.get(kernel, ()), resident, fits))
    return rows
