"""Errors a user of souffle-py can act on.

Every failure that stems from the user's model or inputs is raised as one of these, with the ONNX node or
input it concerns named in the message, so that nobody has to read a TVM stack trace to find the problem.
"""


class SouffleError(Exception):
    """Base class of every error souffle-py raises on purpose."""


class ModelLoadError(SouffleError):
    """The file or object is not a valid ONNX model, or its graph fails the ONNX checker."""


class UnsupportedError(SouffleError):
    """An ONNX node (op type, attribute or input form) that the frontend cannot lower."""

    def __init__(self, node_name: str, op_type: str, what: str):
        self.node_name, self.op_type, self.what = node_name, op_type, what
        super().__init__(f"node '{node_name}' ({op_type}): {what}")


class UnsupportedNodesError(UnsupportedError):
    """Several nodes the frontend cannot lower, named at once (`errors`: one UnsupportedError per node; the
    first one's fields are this error's own), so that a model is not fixed one node per compile."""

    def __init__(self, errors):
        self.errors = list(errors)
        first = self.errors[0]
        self.node_name, self.op_type, self.what = first.node_name, first.op_type, first.what
        SouffleError.__init__(self, f"{len(self.errors)} nodes cannot be lowered:\n"
                              + "\n".join(f"  {error}" for error in self.errors))


class NotConstantError(UnsupportedError):
    """An input that must be known at compile time (axes, a target shape, ...) is computed at run time.

    `value_name` is the ONNX value concerned; a caller that knows its value can make it an initializer."""

    def __init__(self, node_name: str, op_type: str, what: str, value_name: str):
        self.value_name = value_name
        super().__init__(node_name, op_type, what)


class ShapeError(SouffleError):
    """A model input has a symbolic or unknown dimension, or given shapes do not fit the model."""


class DynamicShapeError(ShapeError):
    """optimize(dynamic=...) names an input, axis or symbolic dimension the model does not have, makes a fixed
    dimension dynamic, leaves a symbolic one without a range, or gives a range that is not (min <= max)."""


class InputError(SouffleError):
    """run() was given a missing, unexpected, wrongly shaped or wrongly typed input (or set_num_threads() a
    count that is not a positive integer)."""


class TargetError(SouffleError):
    """An unknown or unsupported compilation target (a misspelled GPU name, an unsupported TVM target kind)."""


class NoDeviceError(SouffleError):
    """The model was compiled for a device this machine does not have (a CUDA model run without a GPU)."""


class ExportError(SouffleError):
    """A compiled model could not be exported, or an exported file cannot be loaded."""


class KernelFitError(SouffleError):
    """A GPU kernel that cannot run: its blocks do not fit an SM, or a cooperative (grid-synchronized)
    grid is larger than the GPU can keep resident at once (such a launch fails without a message)."""


class DeviceError(SouffleError):
    """A kernel failed on the device (a launch error, or a fault such as an illegal address that CUDA
    reports at the next synchronization). `kernel` names the kernel call; after such an error the
    process's CUDA context is unusable, so later runs of the model raise this error again."""

    def __init__(self, message: str, kernel: str | None = None):
        self.kernel = kernel
        super().__init__(message)


class TuningError(SouffleError):
    """Tuning could not measure candidates where it was asked to (base of the RPC tracker's errors)."""


class TrackerUnreachableError(TuningError):
    """No RPC tracker answers at the address given (`--rpc-tracker HOST:PORT`)."""


class NoRpcServersError(TuningError):
    """The RPC tracker has no server registered under the key (`--rpc-key`), or every one of them has gone."""
