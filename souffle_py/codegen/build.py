"""Build kernels for a target: schedule each distinct PrimFunc once, compile all into one module.

Structurally identical PrimFuncs are compiled once and shared, which keeps compile time proportional to
the number of distinct kernels (one BERT layer's worth), not the number of calls.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import tvm
from tvm import tirx

from souffle_py.codegen.fast_math import fresh_lets
from souffle_py.codegen.kernels import Kernel
from souffle_py.codegen.recurrence import close_back_edges
from souffle_py.codegen.stack_locals import PIPELINE
from souffle_py.errors import SouffleError
from souffle_py.failures import RuleFailedError
from souffle_py.structural import StructuralMap

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BuiltKernels:
    """A compiled module, per kernel call the name of its function in the module, and each function as
    scheduled (its launch nests on a GPU)."""

    module: object
    function_of: tuple[str, ...]
    functions: dict
    distinct: int
    seconds: float


def build_kernels(kernels: Sequence[Kernel], target: tvm.target.Target,
                  schedule: Callable[[tirx.PrimFunc], tirx.PrimFunc]) -> BuiltKernels:
    """Schedule each distinct kernel once and compile them all into one module."""
    start = time.perf_counter()
    scheduled = schedule_kernels(kernels, schedule)
    return BuiltKernels(module=compile_functions(scheduled.functions, target), function_of=scheduled.function_of,
                        functions=scheduled.functions, distinct=len(scheduled.functions),
                        seconds=time.perf_counter() - start)


@dataclass
class ScheduledKernels:
    """Distinct kernels by symbol: as scheduled (`functions`) and as given (`kernel_of`)."""

    functions: dict[str, tirx.PrimFunc]
    kernel_of: dict[str, Kernel]
    function_of: tuple[str, ...]

    def reschedule(self, name: str, schedule: Callable[[tirx.PrimFunc], tirx.PrimFunc]) -> None:
        self.functions[name] = scheduled_function(self.kernel_of[name], schedule, name)


def schedule_kernels(kernels: Sequence[Kernel], schedule: Callable[[tirx.PrimFunc], tirx.PrimFunc]) -> ScheduledKernels:
    functions: dict[str, tirx.PrimFunc] = {}
    kernel_of: dict[str, Kernel] = {}
    name_of = StructuralMap()  # identical kernels (BERT's layers) are one function
    function_of = []
    for kernel in kernels:
        name = name_of.get(kernel.func)
        if name is None:
            name = re.sub(r"\W", "_", f"k{len(functions)}_{kernel.name}")[:120]  # a C identifier (CUDA)
            functions[name] = scheduled_function(kernel, schedule, name)
            kernel_of[name] = kernel
            name_of.set(kernel.func, name)
        function_of.append(name)
    return ScheduledKernels(functions, kernel_of, tuple(function_of))


def scheduled_function(kernel: Kernel, schedule, name: str) -> tirx.PrimFunc:
    try:
        scheduled = fresh_lets(close_back_edges(schedule(kernel.func), kernel.loops))
    except RuleFailedError as exc:  # strict mode: the rule's own error, with its kernel named
        raise RuleFailedError(exc.rule, f"{exc.subject} of kernel '{kernel.name}'", exc.cause) from exc.cause
    except SouffleError as exc:
        raise SouffleError(f"scheduling kernel '{kernel.name}' ({', '.join(kernel.stages[:4])}"
                           f"{', ...' if len(kernel.stages) > 4 else ''}) failed: {exc}") from exc
    except Exception as exc:
        raise SouffleError(f"scheduling kernel '{kernel.name}' failed: {exc}") from exc
    return scheduled.with_attr("global_symbol", name)


def compile_functions(functions: dict[str, tirx.PrimFunc], target: tvm.target.Target):
    log.info("compiling %d distinct kernels for %s", len(functions), target.kind.name)
    try:
        return tvm.compile(tvm.IRModule(functions), target=target, tir_pipeline=PIPELINE)
    except Exception as exc:
        raise SouffleError(f"TVM failed to compile the kernels for {target}: {exc}") from exc
