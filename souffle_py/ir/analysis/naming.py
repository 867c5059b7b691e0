"""Unique, identifier-safe names for the TEs and tensors of a program.

The analysis keys everything by name (so its results serialize and read well) and the isl maps use the
names as tuple names, so two tensors must never share one: hand-built TEs are often all called "compute".
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tvm import te

from souffle_py.ir.graph import tensor_key


@dataclass(frozen=True)
class Names:
    """ops: operation (placeholder or TE) -> name; tensors: tensor_key -> name (the op's name when it has
    one output, else `<op>_<output index>`)."""

    ops: dict
    tensors: dict

    def tensor(self, tensor: te.Tensor) -> str:
        return self.tensors[tensor_key(tensor)]


def _identifier(name: str) -> str:
    name = re.sub(r"[^0-9A-Za-z_]", "_", name) or "t"
    return name if not name[0].isdigit() else f"t_{name}"


def name_program(placeholders: list[te.Tensor], stages: list[te.ComputeOp]) -> Names:
    """Names for the placeholders, then the TEs in program order; clashes get a numeric suffix."""
    used: set[str] = set()

    def fresh(base: str) -> str:
        base = _identifier(base)
        name, n = base, 1
        while name in used:
            name, n = f"{base}_{n}", n + 1
        used.add(name)
        return name

    ops, tensors = {}, {}
    for op in [t.op for t in placeholders] + list(stages):
        if op in ops:
            continue
        ops[op] = fresh(op.name)
        outputs = op.num_outputs
        for i in range(outputs):
            tensors[(op, i)] = ops[op] if outputs == 1 else fresh(f"{ops[op]}_{i}")
    return Names(ops, tensors)
