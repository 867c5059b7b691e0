"""TEProgram: the whole model as one tensor-expression DAG.

This is the object every later stage (analysis, transformations, partitioning, scheduling) consumes. It is
immutable: passes build new programs with `replace()` instead of editing one in place.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np
from tvm import te

from souffle_py.ir.graph import compute_ops, consumers, tensor_key


@dataclass(frozen=True)
class TEProgram:
    """A model lowered to TEs.

    inputs:  ONNX graph input name -> te placeholder (the values run() is fed), in graph order.
    params:  placeholder name -> numpy value, for weights and other constants the TEs read.
    param_tensors: placeholder name -> te placeholder, same keys as `params`.
    outputs: ONNX graph output name -> the te.Tensor that computes it, in graph order.
    origins: TE op name -> name of the ONNX node it was lowered from (provenance for reports and errors).
    """

    inputs: Mapping[str, te.Tensor]
    params: Mapping[str, np.ndarray]
    param_tensors: Mapping[str, te.Tensor]
    outputs: Mapping[str, te.Tensor]
    origins: Mapping[str, str] = field(default_factory=dict)

    def replace(self, **changes) -> "TEProgram":
        """A new program with some fields changed (the pass-friendly way to "modify" one)."""
        return dataclasses.replace(self, **changes)

    def rebuilt(self, new_of: Mapping[tuple, te.Tensor], params: Mapping[str, np.ndarray] | None = None,
                param_tensors: Mapping[str, te.Tensor] | None = None) -> "TEProgram":
        """The program whose outputs are computed by the rebuilt tensors `new_of` (old tensor key -> new
        tensor); with `params`, the new constants, those it no longer reads dropped."""
        outputs = {name: new_of.get(tensor_key(t), t) for name, t in self.outputs.items()}
        ops = compute_ops(list(outputs.values()))
        origins = self._inherited_origins(new_of, ops)
        if params is None:
            return self.replace(outputs=outputs, origins=origins)
        read = {t.op.name for op in ops for t in op.input_tensors}
        kept = {n: v for n, v in params.items() if n in read}
        return self.replace(outputs=outputs, params=kept, param_tensors={n: param_tensors[n] for n in kept},
                            origins=origins)

    def _inherited_origins(self, new_of: Mapping[tuple, te.Tensor], ops: list[te.ComputeOp]) -> dict[str, str]:
        """`origins` with the new TEs of a rebuild in it, so that describe() names their ONNX nodes: a TE
        that replaces another takes its node, a new one (a layout copy, a padding) its first reader's."""
        origins = dict(self.origins)
        for (old, _), new in new_of.items():
            if isinstance(new, te.Tensor) and new.op.name not in origins and old.name in origins:
                origins[new.op.name] = origins[old.name]
        readers = consumers(ops)
        for op in reversed(ops):  # readers first
            if op.name not in origins:
                origin = next((origins[r.name] for r in readers.get(op, []) if r.name in origins), None)
                if origin is not None:
                    origins[op.name] = origin
        return origins

    @property
    def stages(self) -> list[te.ComputeOp]:
        """Every compute op, producers before consumers."""
        return compute_ops(list(self.outputs.values()))

    def consumers(self) -> dict[te.Operation, list[te.ComputeOp]]:
        """Op -> the compute ops that read one of its outputs."""
        return consumers(self.stages)

    def placeholder_kind(self, tensor: te.Tensor) -> str:
        """'input' or 'param' for a placeholder of this program."""
        name = tensor.op.name
        if name in self.param_tensors and self.param_tensors[name].same_as(tensor):
            return "param"
        return "input"

    def random_feeds(self, seed: int = 0) -> dict[str, np.ndarray]:
        """Inputs for tests and benchmarks: standard-normal floats, 0/1 integers and booleans."""
        rng = np.random.default_rng(seed)
        feeds = {}
        for name, tensor in self.inputs.items():
            shape, dtype = tuple(int(d) for d in tensor.shape), str(tensor.dtype)
            value = rng.standard_normal(shape) if dtype.startswith("float") else rng.integers(0, 2, shape)
            feeds[name] = value.astype(dtype)
        return feeds

    def summary(self) -> str:
        stages = self.stages
        return (f"TEProgram: {len(self.inputs)} inputs, {len(self.params)} params "
                f"({sum(v.nbytes for v in self.params.values()) / 2**20:.1f} MiB), "
                f"{len(stages)} TEs, {len(self.outputs)} outputs")
