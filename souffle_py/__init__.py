"""souffle-py: whole-model DNN inference optimization in the style of SOUFFLE, on Apache TVM.

    model = souffle_py.optimize("model.onnx")
    outputs = model.run({"input": x})
"""

import os

# TVM's CPU runtime assumes hyper-threading and uses half the cores unless told otherwise; set it before
# TVM starts its thread pool so that souffle-py and every TVM baseline run on all cores.
os.environ.setdefault("TVM_NUM_THREADS", str(os.cpu_count() or 1))

from souffle_py.errors import (DeviceError, DynamicShapeError, ExportError, InputError,  # noqa: E402
                               KernelFitError, ModelLoadError, NoDeviceError, NoRpcServersError, ShapeError, SouffleError, TargetError,
                               TrackerUnreachableError, TuningError, UnsupportedError, UnsupportedNodesError)
from souffle_py.failures import RuleFailedError  # noqa: E402

# The pipeline's entry points load on first use: te_passes/ imports souffle_py.program, and an eager
# `optimize` here would import TVM and the frontend (hence te_passes modules) while one of them is loading.
_LAZY = {"optimize": "souffle_py.api", "set_num_threads": "souffle_py.backends.cpu",
         "CompiledModel": "souffle_py.runtime", "load": "souffle_py.loading",
         "DynamicModel": "souffle_py.dynamic", "RpcTracker": "souffle_py.schedule.runners"}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'souffle_py' has no attribute {name!r}")


__all__ = ["optimize", "load", "set_num_threads", "CompiledModel", "DynamicModel", "RpcTracker", "SouffleError",
           "ModelLoadError", "DynamicShapeError",
           "UnsupportedError", "UnsupportedNodesError", "ShapeError", "InputError", "TargetError", "NoDeviceError",
           "KernelFitError", "ExportError", "DeviceError", "RuleFailedError", "TuningError", "TrackerUnreachableError",
           "NoRpcServersError"]
