"""ONNX frontend: load and check a model, then lower every node to TEs (see lower.py and ops/)."""

from souffle_py.frontend.loader import load_model
from souffle_py.frontend.lower import lower

__all__ = ["load_model", "lower", "import_onnx"]


def import_onnx(model, input_shapes=None):
    """Path or ModelProto -> TEProgram (the checked, concrete-shaped model lowered to TEs)."""
    return lower(load_model(model, input_shapes))
