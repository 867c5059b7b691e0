"""Tensors on the device a compiled model runs on, one place per device kind.

The CPU's are allocated and filled through the TVM runtime library's own functions, called through tvm_ffi
alone (tvm_runtime.py): a process that only runs models (a service loading from the compile cache) never
imports the `tvm` package. CUDA's go through `tvm.runtime`.
"""

from __future__ import annotations

import ctypes

import numpy as np

from souffle_py.tvm_runtime import ffi

# bytes per element of the buffer types kernels take (numpy has no bfloat16)
_ITEMSIZE = {"bool": 1, "int8": 1, "uint8": 1, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4, "int64": 8,
             "uint64": 8, "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


def itemsize(dtype: str) -> int:
    """Bytes per element of a buffer type ("float32", "bfloat16", ...)."""
    try:
        return _ITEMSIZE[dtype]
    except KeyError:
        return np.dtype(dtype).itemsize


class HostMemory:
    """CPU tensors: the runtime's aligned allocations; inputs and outputs also seen as numpy views."""

    kind = "cpu"

    def __init__(self):
        tvm_ffi = ffi()
        self.device = tvm_ffi.device("cpu", 0)
        self._alloc = tvm_ffi.get_global_func("runtime.TVMTensorAllocWithScope")
        self._copy_from_bytes = tvm_ffi.get_global_func("runtime.TVMTensorCopyFromBytes")
        self._shape, self._dtype = tvm_ffi.Shape, tvm_ffi.dtype

    def empty(self, shape, dtype: str):
        return self._alloc(self._shape(tuple(int(d) for d in shape)), self._dtype(dtype), self.device, None)

    def upload(self, values: np.ndarray, shape, dtype: str):
        """A new tensor holding `values` bit for bit (same itemsize; bfloat16 comes as 2-byte items)."""
        tensor = self.empty(shape, dtype)
        values = np.ascontiguousarray(values)
        self._copy_from_bytes(tensor, values.ctypes.data_as(ctypes.c_void_p), values.nbytes)
        return tensor

    @staticmethod
    def view(tensor) -> np.ndarray:
        return np.from_dlpack(tensor)

    def sync(self) -> None:
        """Kernels on the host return when done."""


class CudaMemory:
    """GPU tensors through tvm.runtime (the device checked by devices.device_for)."""

    kind = "cuda"

    def __init__(self, device):
        self.device = device

    def empty(self, shape, dtype: str):
        import tvm

        return tvm.runtime.empty(tuple(shape), dtype, self.device)

    def upload(self, values: np.ndarray, shape, dtype: str):
        import tvm

        if str(values.dtype) == dtype:
            return tvm.runtime.tensor(values, self.device)
        tensor = self.empty(shape, dtype)  # bfloat16 as its 2-byte bits, copied as they are
        tensor.copyfrom(np.ascontiguousarray(values).view(np.uint16 if values.dtype.itemsize == 2 else values.dtype))
        return tensor

    @staticmethod
    def view(tensor):
        return None

    def sync(self) -> None:
        self.device.sync()


def memory_for(kind: str):
    """The memory of a device kind ("cpu" or "cuda"; the GPU checked present first)."""
    if kind == "cpu":
        return HostMemory()
    from souffle_py.devices import device_for

    return CudaMemory(device_for(kind))


def load_library(path: str, kind: str):
    """A kernel library: for the CPU through tvm_ffi alone, else through tvm.runtime."""
    if kind == "cpu":
        return ffi().load_module(path)
    import tvm

    return tvm.runtime.load_module(path)
