"""souffle-py: whole-model DNN inference optimization in the style of SOUFFLE, on Apache TVM.

    model = souffle_py.optimize("model.onnx")
    outputs = model.run({"input": x})
"""

import os

# TVM's CPU runtime assumes hyper-threading and uses half the cores unless told otherwise; set it before
# TVM starts its thread pool so that souffle-py and every TVM baseline run on all cores.
os.environ.setdefault("TVM_NUM_THREADS", str(os.cpu_count() or 1))

from souffle_py.errors import (DeviceError, DynamicShapeError, ExportError, InputError,  # noqa: E402
                               KernelFitError, ModelLoadError, NoDeviceError, NoRpcServersError, ShapeError,
                               SouffleError, TargetError, TrackerUnreachableError, TuningError, UnsupportedError,
                               UnsupportedNodesError)
from souffle_py.failures import RuleFailedError  # noqa: E402

from souffle_py.api import optimize  # noqa: E402  (light: the compiler is imported by a compile, not here)
from souffle_py.dynamic import DynamicModel  # noqa: E402
from souffle_py.host import set_num_threads  # noqa: E402
from souffle_py.loading import load  # noqa: E402
from souffle_py.runtime import CompiledModel  # noqa: E402
from souffle_py.schedule.runners import RpcTracker  # noqa: E402

__all__ = ["optimize", "load", "set_num_threads", "CompiledModel", "DynamicModel", "RpcTracker", "SouffleError",
           "ModelLoadError", "DynamicShapeError",
           "UnsupportedError", "UnsupportedNodesError", "ShapeError", "InputError", "TargetError", "NoDeviceError",
           "KernelFitError", "ExportError", "DeviceError", "RuleFailedError", "TuningError", "TrackerUnreachableError",
           "NoRpcServersError"]
