"""torch.nn equivalents of the models/ builders, loaded with the ONNX model's own weights.

They are the PyTorch baselines of the GPU benchmark: each is written as a PyTorch user would write the model
(nn.Linear, nn.Conv2d + nn.BatchNorm2d, nn.LSTM, scaled_dot_product_attention), with its configuration
recovered from the ONNX graph (initializer shapes, a few node attributes), so any config of a builder works
without passing the Config along. torch is imported only when a module is requested: importing this package
without torch installed works, asking it for a module raises a SouffleError saying so.
"""

from __future__ import annotations

import importlib
import importlib.util

import onnx

from models.registry import MODEL_NAMES
from souffle_py.errors import SouffleError


# the models/ builders that have a torch.nn equivalent here (sbert has none: its token inputs take no fp16 path)
TORCH_MODEL_NAMES = tuple(name for name in MODEL_NAMES
                          if importlib.util.find_spec(f"models.torch_equivalents.{name}") is not None)


def require_torch():
    """The torch module, or a SouffleError that says PyTorch is needed (it is no dependency of souffle-py)."""
    try:
        import torch
    except ImportError as exc:
        raise SouffleError("the PyTorch baselines need PyTorch, which is not installed "
                           "(it is not a dependency of souffle-py; install the build that fits your GPU)") from exc
    return torch


def torch_module(name: str, proto: onnx.ModelProto):
    """A torch.nn.Module (float32, CPU, eval mode) computing what the models/ builder `name` built in `proto`.

    Its forward takes the graph inputs positionally and returns the graph outputs (one tensor, as every
    model here has one output).
    """
    if name not in TORCH_MODEL_NAMES:
        raise SouffleError(f"no PyTorch equivalent for model {name!r}; models with one: {', '.join(TORCH_MODEL_NAMES)}")
    require_torch()
    builder = importlib.import_module(f"models.torch_equivalents.{name}")
    from models.torch_equivalents.common import OnnxWeights, load_weights

    weights = OnnxWeights(proto, name)
    module, state = builder.build(weights)
    load_weights(module, state, name)
    weights.check_all_used()
    return module.eval().requires_grad_(False)


def model_name(proto: onnx.ModelProto) -> str:
    """Which models/ builder made `proto`: GraphBuilder names the graph after the model."""
    name = proto.graph.name
    if name not in MODEL_NAMES:
        raise SouffleError(f"graph {name!r} was not built by models/ (expected a graph named one of "
                           f"{', '.join(MODEL_NAMES)}), so there is no PyTorch equivalent for it")
    return name


def torch_equivalent(proto: onnx.ModelProto):
    """torch_module() for a model recognized by its graph name."""
    return torch_module(model_name(proto), proto)
