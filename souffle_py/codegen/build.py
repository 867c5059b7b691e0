"""Build kernels for a target: schedule each distinct PrimFunc once, compile all into one module.

Structurally identical PrimFuncs are compiled once and shared, which keeps compile time proportional to
the number of distinct kernels (one BERT layer's worth), not the number of calls.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import tvm
import tvm_ffi
from tvm import tirx

from souffle_py.codegen.kernels import Kernel
from souffle_py.codegen.recurrence import close_back_edges
from souffle_py.errors import SouffleError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BuiltKernels:
    """A compiled module and, per kernel call, the name of its function in the module."""

    module: object
    function_of: tuple[str, ...]
    distinct: int
    seconds: float


def build_kernels(kernels: Sequence[Kernel], target: tvm.target.Target,
                  schedule: Callable[[tirx.PrimFunc], tirx.PrimFunc]) -> BuiltKernels:
    start = time.perf_counter()
    functions: dict[str, tirx.PrimFunc] = {}
    by_hash: dict[int, list[tuple[tirx.PrimFunc, str]]] = {}
    function_of = []
    for kernel in kernels:
        key = tvm_ffi.structural_hash(kernel.func)
        name = next((n for f, n in by_hash.get(key, []) if tvm_ffi.structural_equal(f, kernel.func)), None)
        if name is None:
            name = f"k{len(functions)}_{kernel.name}"[:120]
            try:
                scheduled = close_back_edges(schedule(kernel.func), kernel.loops)
            except Exception as exc:
                raise SouffleError(f"scheduling kernel '{kernel.name}' failed: {exc}") from exc
            functions[name] = scheduled.with_attr("global_symbol", name)
            by_hash.setdefault(key, []).append((kernel.func, name))
        function_of.append(name)
    log.info("compiling %d distinct kernels (%d calls) for %s", len(functions), len(kernels), target.kind.name)
    try:
        module = tvm.compile(tvm.IRModule(functions), target=target)
    except Exception as exc:
        raise SouffleError(f"TVM failed to compile the kernels for {target}: {exc}") from exc
    return BuiltKernels(module=module, function_of=tuple(function_of), distinct=len(functions),
                        seconds=time.perf_counter() - start)
