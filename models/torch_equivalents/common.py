"""Reading an ONNX model's weights into torch modules, and the conv + BatchNorm unit the CNNs share.

Loading is strict both ways: every parameter and buffer of the torch module must come from the ONNX model,
and every float weight of the ONNX model must end up in the module, so a builder change that adds or renames
a weight fails loudly instead of leaving a randomly initialized layer in a baseline.
"""

from __future__ import annotations

from itertools import chain
from typing import Mapping

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper
from torch import nn

from models.common import BN_EPS
from souffle_py.errors import SouffleError


class OnnxWeights:
    """Initializers by name (as numpy arrays), node attributes and input shapes of one models/ graph."""

    def __init__(self, proto: onnx.ModelProto, model: str):
        self.model = model
        self._initializers = {t.name: t for t in proto.graph.initializer}
        self._nodes = {n.name: n for n in proto.graph.node}
        self._used: set[str] = set()
        self.input_shapes = [tuple(d.dim_value for d in i.type.tensor_type.shape.dim)
                             for i in proto.graph.input if i.name not in self._initializers]

    def has(self, name: str) -> bool:
        return name in self._initializers

    def _tensor(self, name: str) -> onnx.TensorProto:
        if name not in self._initializers:
            raise SouffleError(f"{self.model}: the ONNX graph has no initializer {name!r}; the PyTorch "
                               f"equivalent expects a graph as models/{self.model}.py builds it")
        return self._initializers[name]

    def __getitem__(self, name: str) -> np.ndarray:
        """The initializer's value; marks it as loaded into the torch module."""
        self._used.add(name)
        return numpy_helper.to_array(self._tensor(name))

    def shape(self, name: str) -> tuple[int, ...]:
        """The initializer's shape, for recovering the configuration (does not count as loading it)."""
        return tuple(self._tensor(name).dims)

    def count(self, template: str) -> int:
        """How many of template.format(0), template.format(1), ... exist: layers, blocks, experts."""
        n = 0
        while self.has(template.format(n)):
            n += 1
        return n

    def attribute(self, node_name: str, attribute: str):
        node = self._nodes.get(node_name)
        if node is None:
            raise SouffleError(f"{self.model}: the ONNX graph has no node {node_name!r}; the PyTorch "
                               f"equivalent expects a graph as models/{self.model}.py builds it")
        for a in node.attribute:
            if a.name == attribute:
                return helper.get_attribute_value(a)
        raise SouffleError(f"{self.model}: node {node_name!r} has no attribute {attribute!r}")

    def check_all_used(self) -> None:
        """Every float weight (not scalar constants such as sqrt(2)) must have been loaded."""
        unused = sorted(name for name, t in self._initializers.items()
                        if name not in self._used and t.data_type == onnx.TensorProto.FLOAT and len(t.dims))
        if unused:
            raise SouffleError(f"{self.model}: the PyTorch equivalent does not use the ONNX weights "
                               f"{', '.join(unused[:5])}{' ...' if len(unused) > 5 else ''}; it no longer "
                               f"matches models/{self.model}.py")


def load_weights(module: nn.Module, state: Mapping[str, np.ndarray], model: str) -> None:
    """Copy `state` into every parameter and buffer of `module` (BatchNorm's batch counter aside)."""
    targets = {name: t for name, t in chain(module.named_parameters(), module.named_buffers())
               if not name.endswith("num_batches_tracked")}
    missing, unexpected = sorted(targets.keys() - state.keys()), sorted(state.keys() - targets.keys())
    if missing or unexpected:
        raise SouffleError(f"{model}: the ONNX weights do not cover the torch module (not loaded: {missing[:5]}, "
                           f"no such parameter: {unexpected[:5]})")
    with torch.no_grad():
        for name, target in targets.items():
            value = torch.from_numpy(np.array(state[name]))  # a writable copy (ONNX's arrays are read-only)
            if tuple(value.shape) != tuple(target.shape):
                raise SouffleError(f"{model}: ONNX weight for {name} has shape {tuple(value.shape)}, "
                                   f"the torch module expects {tuple(target.shape)}")
            target.copy_(value)


class ConvBN(nn.Module):
    """A bias-free Conv2d with "same" padding and an eval-mode BatchNorm2d, as models.common.conv_bn builds.

    With `folded` the BatchNorm is already folded into the conv, which then carries a bias instead.
    """

    def __init__(self, cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1,
                 folded: bool = False):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel, stride, padding=kernel // 2, groups=groups, bias=folded)
        self.bn = nn.Identity() if folded else nn.BatchNorm2d(cout, eps=BN_EPS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x))


def conv_bn_state(weights: OnnxWeights, onnx_name: str, prefix: str, folded: bool = False) -> dict:
    """The state of a ConvBN at `prefix` from the weights of models.common.conv_bn(name=onnx_name)."""
    state = {f"{prefix}.conv.weight": weights[f"{onnx_name}/weight"]}
    if folded:
        state[f"{prefix}.conv.bias"] = weights[f"{onnx_name}/bias"]
        return state
    for torch_name, onnx_suffix in (("weight", "gamma"), ("bias", "beta"), ("running_mean", "mean"),
                                    ("running_var", "var")):
        state[f"{prefix}.bn.{torch_name}"] = weights[f"{onnx_name}/bn_{onnx_suffix}"]
    return state


def linear_state(weights: OnnxWeights, weight: str, bias: str | None, prefix: str) -> dict:
    """An nn.Linear's state from an ONNX MatMul weight ([in, out], hence transposed) and optional bias."""
    state = {f"{prefix}.weight": weights[weight].T}
    if bias is not None:
        state[f"{prefix}.bias"] = weights[bias]
    return state
