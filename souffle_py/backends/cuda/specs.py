"""NVIDIA GPUs by name, the present GPU, and the TVM target for each.

The partitioner needs what CUDA's occupancy calculation needs (SMs, registers and shared memory per SM
and per block, threads and blocks per SM); named targets carry their datasheet figures, "cuda" reads the
SM count, shared memory and compute capability of the present GPU and, without one, compiles for an
H100-class sm_90 so that compiling never needs a GPU.
"""

from __future__ import annotations

from dataclasses import replace

import tvm

from souffle_py.errors import TargetError
from souffle_py.partition import A100, H100, H200, HardwareSpec

# name -> (spec, arch); per-SM limits from NVIDIA's CUDA occupancy tables for compute capability 8.0 / 9.0
GPUS = {"a100": (A100, "sm_80"), "h100": (H100, "sm_90"), "h200": (H200, "sm_90")}
BY_ARCH = {"sm_80": A100, "sm_90": H100}
DEFAULT = "h100"
STATIC_SHARED_MEMORY = 48 * 1024  # a kernel without the dynamic shared-memory opt-in gets at most this


def gpu_present() -> bool:
    """Whether TVM's CUDA runtime sees a GPU (False, not an error, on a machine without the driver)."""
    try:
        return bool(tvm.cuda(0).exist)
    except Exception:
        return False


def cuda_target(arch: str, spec: HardwareSpec) -> tvm.target.Target:
    """A cuda Target for `arch` whose limits are the spec's (a host of generic x86-64, so that exported
    libraries run on any x86-64 GPU machine)."""
    return tvm.target.Target({
        "kind": "cuda", "arch": arch, "max_threads_per_block": 1024, "thread_warp_size": 32,
        "max_shared_memory_per_block": STATIC_SHARED_MEMORY, "registers_per_block": 65536,
        "max_num_threads": 1024}, host={"kind": "llvm"})


def present_gpu() -> tuple[HardwareSpec, str]:
    """The present GPU's spec (SM count and shared memory from the device) and arch."""
    device = tvm.cuda(0)
    arch = "sm_" + device.compute_version.replace(".", "")
    base = BY_ARCH.get(arch, H100 if arch >= "sm_90" else A100)
    name = device.device_name or base.name
    return replace(base, name=name, sms=int(device.multi_processor_count)), arch


def resolve(target) -> tuple[tvm.target.Target, HardwareSpec]:
    """(Target, spec) for "cuda", "h100", "h200", "a100" or a cuda tvm Target."""
    if isinstance(target, tvm.target.Target):
        arch = str(target.attrs.get("arch", "sm_90"))
        base = BY_ARCH.get(arch.rstrip("af"), H100 if arch >= "sm_90" else A100)
        if gpu_present():
            device_spec, device_arch = present_gpu()
            if device_arch == arch.rstrip("af"):
                base = device_spec
        return target, base
    name = str(target).strip().lower()
    if name == "cuda":
        spec, arch = present_gpu() if gpu_present() else GPUS[DEFAULT]
    elif name in GPUS:
        spec, arch = GPUS[name]
    else:
        raise TargetError(f"unknown GPU {target!r}: expected cuda, {', '.join(sorted(GPUS))} or a tvm Target")
    return cuda_target(arch, spec), spec
