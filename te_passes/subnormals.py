"""Float parameters without subnormal values: a CPU lowering pass (passes/cpu.py).

A multiply or FMA with a subnormal operand takes a microcode assist on x86 cores: ConViT's folded positional
attention (g * softmax(pos_proj(rel)), 9% subnormal) made its mixing `(1 - g) * softmax(q k) + C` 4x slower
(0.30 against 0.07 ms) where ONNX Runtime's plain Add is not. Constants are flushed to zero, a change of at
most 1.2e-38 in float32; computed values are not touched (no FTZ/DAZ at run time).
"""

from __future__ import annotations

import numpy as np

from souffle_py.ir.program import TEProgram


def without_subnormals(array: np.ndarray) -> np.ndarray:
    """`array` with its subnormal values (below the dtype's smallest normal) made zero."""
    if array.dtype.kind != "f":
        return array
    subnormal = (array != 0) & (np.abs(array) < np.finfo(array.dtype).tiny)
    return np.where(subnormal, array.dtype.type(0), array) if subnormal.any() else array


class _Flushed:
    def __init__(self, names: list[str]):
        self.names = names

    def summary(self) -> str:
        return (f"subnormals made zero in {len(self.names)} parameter(s): {', '.join(self.names[:4])}"
                + (" ..." if len(self.names) > 4 else "")) if self.names else "no subnormal parameter"


def flush_subnormal_params(program: TEProgram) -> tuple[TEProgram, _Flushed]:
    """`program` with every float parameter's subnormal values made zero (the same program where none has
    any), and which parameters changed."""
    params = {name: without_subnormals(value) for name, value in program.params.items()}
    changed = [name for name, value in params.items() if value is not program.params[name]]
    return (program.replace(params=params) if changed else program), _Flushed(changed)
