"""The lowering rule table and the per-node view that rules work through.

A rule is a function `rule(ctx: NodeContext) -> list of outputs`, registered for one or more ONNX op types
with `@register(...)`. An output is a te.Tensor, or a numpy array when the rule can compute it at compile
time (e.g. Shape). Rules never touch the graph-wide state directly: the context hands them tensors and
constants and turns every complaint into an UnsupportedError that names the node.
"""

from __future__ import annotations

import re
from typing import Callable, Iterable, Sequence

import numpy as np
import onnx
from onnx import helper
from tvm import te

from souffle_py.errors import NotConstantError, UnsupportedError

Value = "te.Tensor | np.ndarray"
Rule = Callable[["NodeContext"], Sequence]

RULES: dict[str, Rule] = {}
# Attributes a rule understands, per op type; anything else on a node is rejected by name.
KNOWN_ATTRIBUTES: dict[str, frozenset[str]] = {}


def register(*op_types: str, attributes: Iterable[str] = ()):
    """Register a lowering rule for `op_types`; `attributes` lists the ONNX attributes it honours."""

    def wrap(rule: Rule) -> Rule:
        for op_type in op_types:
            if op_type in RULES:
                raise ValueError(f"two lowering rules for {op_type}")
            RULES[op_type] = rule
            KNOWN_ATTRIBUTES[op_type] = frozenset(attributes)
        return rule

    return wrap


def sanitize(name: str) -> str:
    """A C-identifier-safe version of an ONNX name (TVM buffer and kernel names end up in source code)."""
    name = re.sub(r"[^0-9A-Za-z_]", "_", name).strip("_") or "t"
    return name if not name[0].isdigit() else f"t_{name}"


class NodeContext:
    """What a rule sees of one ONNX node: its inputs as tensors or constants, its attributes, its opset."""

    def __init__(self, node: onnx.NodeProto, node_name: str, opset: int,
                 values: Sequence[object], tensor_of: Callable[[str], te.Tensor],
                 new_param: Callable[[np.ndarray, str], te.Tensor]):
        self.node = node
        self.name = node_name
        self.op_type = node.op_type
        self.opset = opset
        self._values = values  # per input position: te.Tensor, np.ndarray, or None for an omitted input
        self._tensor_of = tensor_of
        self.new_param = new_param  # (array, base name) -> placeholder of a constant the rule derived
        self.attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}

    # --- complaints ---------------------------------------------------------------------------------
    def unsupported(self, what: str) -> UnsupportedError:
        """The error to raise: `raise ctx.unsupported("...")`."""
        return UnsupportedError(self.name, self.op_type, what)

    # --- inputs -------------------------------------------------------------------------------------
    @property
    def num_inputs(self) -> int:
        return len(self._values)

    def has(self, i: int) -> bool:
        """Whether optional input i is given (ONNX marks an omitted input with an empty name)."""
        return i < len(self._values) and self._values[i] is not None

    def value(self, i: int):
        """Input i as it is: a te.Tensor, or a numpy array when it is known at compile time."""
        if not self.has(i):
            raise self.unsupported(f"input {i} is required")
        return self._values[i]

    def tensor(self, i: int) -> te.Tensor:
        """Input i as a te.Tensor (a compile-time constant becomes a parameter placeholder)."""
        value = self.value(i)
        return self._tensor_of(self.node.input[i]) if isinstance(value, np.ndarray) else value

    def const(self, i: int, what: str = "") -> np.ndarray:
        """Input i, which must be known at compile time (shapes, axes, split sizes, ...)."""
        value = self.value(i)
        if not isinstance(value, np.ndarray):
            purpose = f" ({what})" if what else ""
            raise NotConstantError(self.name, self.op_type, f"input {i} '{self.node.input[i]}'{purpose} must be a "
                                   "compile-time constant; data-dependent values are not supported",
                                   self.node.input[i])
        return value

    def is_const(self, i: int) -> bool:
        return self.has(i) and isinstance(self._values[i], np.ndarray)

    def shape(self, i: int) -> tuple[int, ...]:
        value = self.value(i)
        return tuple(value.shape) if isinstance(value, np.ndarray) else tuple(int(d) for d in value.shape)

    def dtype(self, i: int) -> str:
        value = self.value(i)
        return str(value.dtype)

    # --- attributes ---------------------------------------------------------------------------------
    def attr(self, name: str, default=None):
        value = self.attrs.get(name, default)
        return value.decode() if isinstance(value, bytes) else value

    def ints_from(self, attr: str, input_index: int, what: str) -> list[int] | None:
        """A list of ints given as an attribute (older opsets) or as a constant input (newer ones)."""
        if attr in self.attrs:
            return [int(v) for v in self.attrs[attr]]
        if self.has(input_index):
            return [int(v) for v in np.asarray(self.const(input_index, what)).reshape(-1)]
        return None

    def axis(self, axis: int, rank: int) -> int:
        """Normalize a possibly negative axis, rejecting out-of-range ones by name."""
        if not -rank <= axis < max(rank, 1):
            raise self.unsupported(f"axis {axis} is out of range for a rank-{rank} tensor")
        return axis % rank if rank else 0
