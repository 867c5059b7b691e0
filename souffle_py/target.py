"""Targets: turn "llvm"/"cuda" or a tvm Target into the Target and device souffle-py compiles for.

TVM 0.27 rejects strings like "llvm -num-cores 2", so the host target is built from a dict with the
machine's CPU and core count.
"""

from __future__ import annotations

import os

import tvm

from souffle_py.errors import SouffleError


def num_threads() -> int:
    """Threads for TVM's CPU runtime: TVM_NUM_THREADS, else every core (TVM's own default halves it)."""
    return int(os.environ.get("TVM_NUM_THREADS", os.cpu_count() or 1))


def resolve_target(target: "str | tvm.target.Target") -> tvm.target.Target:
    if isinstance(target, tvm.target.Target):
        return target
    if target in ("llvm", "cpu"):
        return tvm.target.Target({"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu(),
                                  "num-cores": num_threads()})
    if target == "cuda":
        return tvm.target.Target({"kind": "cuda", "arch": "sm_80"})
    try:
        return tvm.target.Target(target)
    except Exception as exc:
        raise SouffleError(f"unknown target {target!r}: {exc}") from None


def compilable_target(target: "str | tvm.target.Target") -> tvm.target.Target:
    """The resolved target if souffle-py generates kernels for it today, else a SouffleError that says why.

    Only CPU kernels exist: the default schedules bind no GPU threads, so a CUDA build would be one
    GPU thread per kernel (the partitioner's CUDA occupancy policy is ready; the schedules are not).
    """
    resolved = resolve_target(target)
    if resolved.kind.name != "llvm":
        raise SouffleError(f"target '{resolved.kind.name}' is not supported yet: souffle-py generates CPU "
                           "kernels only (target='llvm'); GPU schedules and grid synchronization are not "
                           "implemented")
    return resolved


def device_of(target: tvm.target.Target) -> tvm.runtime.Device:
    return tvm.cpu() if target.kind.name == "llvm" else tvm.device(target.kind.name)
