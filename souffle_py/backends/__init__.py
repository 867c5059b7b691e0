"""One place per target: what differs between the CPU and a GPU, behind one small interface.

`optimize()` is one straight pipeline; at the few points where targets differ it asks the backend:
- `prepare`: target-specific layouts (the CPU packs GEMM weights into panels), for every build;
- `restructure`: program rewrites that only the merged kernels get (CUDA: the LSTM's layer x time
  wavefront, split reductions), not the unfused reference;
- `fused_kernels`: how the transformed program becomes kernels (the partition policy and merging);
- `scheduler`: the default schedules and, with a database, the tuned ones;
- `build`: scheduling and compiling (CUDA: then nvcc, the binary, each kernel's launch and resources).
Adding a target is a new module here with a `Backend` subclass, registered in `backend_for`.
"""

from __future__ import annotations

import json

import tvm

from souffle_py.backends.base import Backend, Finished, Schedule  # noqa: F401  (the package's interface)
from souffle_py.errors import TargetError


def backend_for(target: "str | tvm.target.Target") -> Backend:
    """The backend of a target: "llvm"/"cpu" (the host), a CPU as "llvm -mcpu=haswell ...", a dict or its
    JSON, a CPU's short name ("avx2", "graviton3": cpu_target.CPU_NAMES), "cuda" (the present GPU, else an H100-class sm_90), "h100", "h200", "a100", or a
    tvm Target of kind llvm or cuda."""
    from souffle_py.backends import cpu, cuda

    if not isinstance(target, tvm.target.Target) and _cpu_kind(target) in cpu.NAMES:
        return cpu.CpuBackend.for_target(target)
    kind = target.kind.name if isinstance(target, tvm.target.Target) else str(target).strip().lower()
    if kind in cpu.NAMES:
        return cpu.CpuBackend.for_target(target)
    if kind in cuda.NAMES:
        return cuda.CudaBackend.for_target(target)
    if isinstance(target, str):
        try:
            parsed = tvm.target.Target(target)
        except Exception as exc:
            raise TargetError(f"unknown target {target!r}: expected one of llvm, cuda, "
                              f"{', '.join(sorted(cuda.GPUS))} or a tvm Target ({exc})") from None
        return backend_for(parsed)
    raise TargetError(f"target kind '{kind}' is not supported: souffle-py generates code for llvm (CPU) and cuda")


def _cpu_kind(target) -> str:
    """The kind a dict, a JSON object or a CLI string ("llvm -mcpu=haswell") names; "" for anything else."""
    if isinstance(target, dict):
        return str(target.get("kind", "")).lower()
    from souffle_py.cpu_target import CPU_NAMES

    text = str(target).strip()
    if text.lower() in CPU_NAMES:
        return "llvm"
    if text.startswith("{"):
        try:
            return str(json.loads(text).get("kind", "")).lower()
        except (ValueError, AttributeError):
            return ""
    return text.split()[0].lower() if text else ""
