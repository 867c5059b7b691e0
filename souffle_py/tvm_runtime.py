"""The TVM runtime library through tvm_ffi alone, for processes that run compiled models and compile none.

Importing the `tvm` package loads the compiler, Relax and disco, and (with torch installed) torch, which
tvm_ffi imports eagerly for its DLPack interop with torch tensors: 2.6 s of a 3.8 s compile-cache hit on
BERT-base. Running a CPU model needs only libtvm_runtime (the allocator, the parallel launch, the module
loader) and tvm_ffi to call it. A leaf module: it imports nothing of souffle-py.
"""

from __future__ import annotations

import ctypes
import importlib.abc
import importlib.util
import os
import sys
import threading

TORCH_ENV = "SOUFFLE_FFI_TORCH"   # "1": let tvm_ffi import torch (its interop with torch tensors)
_lock = threading.Lock()
_runtime = None


class _WithoutTorch(importlib.abc.MetaPathFinder):
    """Refuses `import torch` while tvm_ffi initializes (it tries torch first, only to support torch
    tensors as arguments, which souffle-py never passes), unless torch is already imported."""

    def find_spec(self, name, path, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("souffle-py imports tvm_ffi without torch (SOUFFLE_FFI_TORCH=1 keeps it)")
        return None


def ffi():
    """tvm_ffi, with the TVM runtime library loaded (its allocator, parallel launch and module loader)."""
    global _runtime
    if _runtime is None:
        with _lock:
            if _runtime is None:
                _runtime = _load_runtime()
    return _runtime


def _load_runtime():
    blocker = None
    if "tvm_ffi" not in sys.modules and "torch" not in sys.modules and os.environ.get(TORCH_ENV) != "1":
        blocker = _WithoutTorch()
        sys.meta_path.insert(0, blocker)
    try:
        import tvm_ffi
    finally:
        if blocker is not None:
            sys.meta_path.remove(blocker)
    if "tvm" not in sys.modules:  # the package loads the same library itself; without it, load it here
        spec = importlib.util.find_spec("tvm")
        library = os.path.join(spec.submodule_search_locations[0], "lib", "libtvm_runtime.so")
        ctypes.CDLL(library, ctypes.RTLD_GLOBAL)
    return tvm_ffi
