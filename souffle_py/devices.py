"""The device a compiled model runs on, checked before anything touches it: a CUDA model on a machine
without a GPU gets a NoDeviceError that says so (TVM's own error would be an opaque runtime failure)."""

from __future__ import annotations

import tvm

from souffle_py.errors import NoDeviceError


def device_for(kind: str) -> tvm.runtime.Device:
    if kind == "cpu":
        return tvm.cpu(0)
    if kind == "cuda":
        from souffle_py.backends.cuda.nvcc import install_callback
        from souffle_py.backends.cuda.specs import gpu_present

        if not gpu_present():
            raise NoDeviceError("this model was compiled for cuda and this machine has no CUDA GPU (TVM's CUDA "
                                "runtime sees none): run it on a GPU machine, e.g. model.export('m.tar') here "
                                "and souffle_py.load('m.tar').run(...) there")
        install_callback()  # the device binary built with the model, not a compile at load time
        return tvm.cuda(0)
    raise NoDeviceError(f"unknown device kind {kind!r} (expected cpu or cuda)")
