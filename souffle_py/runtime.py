"""CompiledModel: the executable form of a model — buffers, a kernel table and the calls per inference."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import tvm

from souffle_py.codegen.build import BuiltKernels
from souffle_py.codegen.kernels import Kernel, buffer_name, buffer_specs
from souffle_py.errors import InputError
from souffle_py.program import TEProgram


@dataclass(frozen=True)
class InputSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str


class CompiledModel:
    """Run a compiled model: `run(feeds) -> outputs`, `benchmark()`, `describe()`, `num_kernels`."""

    def __init__(self, program: TEProgram, kernels: Sequence[Kernel], built: BuiltKernels,
                 device: tvm.runtime.Device, target: tvm.target.Target, compile_seconds: float = 0.0):
        self.program = program
        self.kernels = tuple(kernels)
        self.target = target
        self.device = device
        self.compile_seconds = compile_seconds
        self.distinct_kernels = built.distinct
        self.inputs = tuple(InputSpec(n, tuple(int(d) for d in t.shape), str(t.dtype))
                            for n, t in program.inputs.items())
        self.output_names = tuple(program.outputs)
        specs = buffer_specs(program)
        self._buffers = {name: tvm.runtime.empty(shape, dtype, device) for name, (shape, dtype) in specs.items()
                         if name not in program.params}
        for name, value in program.params.items():
            self._buffers[name] = tvm.runtime.tensor(value, device)
        self._input_buffers = {spec.name: self._buffers[buffer_name(program.inputs[spec.name])]
                               for spec in self.inputs}
        self._output_buffers = {name: self._buffers[buffer_name(t)] for name, t in program.outputs.items()}
        self._calls = [(built.module[fn], [self._buffers[a] for a in k.args])
                       for k, fn in zip(self.kernels, built.function_of)]

    @property
    def num_kernels(self) -> int:
        """Kernel (PrimFunc) calls per inference."""
        return len(self._calls)

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Outputs by name for one inference on `feeds` (input name -> array of the declared shape and dtype)."""
        self._load(feeds)
        self._execute()
        return {name: buf.numpy() for name, buf in self._output_buffers.items()}

    def benchmark(self, feeds: Mapping[str, np.ndarray] | None = None, repeat: int = 10,
                  warmup: int = 2) -> dict[str, float]:
        """Latency of the kernel calls of one inference in ms: median, min and max over `repeat` runs."""
        self._load(feeds if feeds is not None else self.random_feeds())
        for _ in range(warmup):
            self._execute()
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            self._execute()
            self.device.sync()
            times.append((time.perf_counter() - start) * 1e3)
        return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times),
                "repeat": repeat, "times_ms": times}

    def random_feeds(self, seed: int = 0) -> dict[str, np.ndarray]:
        return self.program.random_feeds(seed)

    def describe(self) -> str:
        """One line per kernel call: the function it runs and the TEs (with their ONNX nodes) inside."""
        lines = [f"{self.num_kernels} kernel calls, {self.distinct_kernels} distinct kernels, target {self.target}"]
        for i, kernel in enumerate(self.kernels):
            nodes = sorted({self.program.origins.get(s, "?") for s in kernel.stages})
            lines.append(f"  [{i:4d}] {kernel.name}: {len(kernel.stages)} TEs from {len(nodes)} ONNX nodes"
                         + (f" -- {kernel.reason}" if kernel.reason else ""))
            lines.append(f"         TEs: {', '.join(kernel.stages)}")
            lines.append(f"         ONNX nodes: {', '.join(nodes)}")
            if kernel.loops:
                lines.append(f"         time loops: {len(kernel.loops)} (recurrences; each step reads the previous "
                             "one in place)")
        return "\n".join(lines)

    def _execute(self) -> None:
        for func, args in self._calls:
            func(*args)

    def _load(self, feeds: Mapping[str, np.ndarray]) -> None:
        if not isinstance(feeds, Mapping):
            raise InputError(f"feeds must be a dict of input name -> numpy array, got {type(feeds).__name__}")
        expected = {spec.name: spec for spec in self.inputs}
        missing = [n for n in expected if n not in feeds]
        if missing:
            raise InputError(f"missing input(s) {missing}; the model expects "
                             + ", ".join(f"'{s.name}' {list(s.shape)} {s.dtype}" for s in self.inputs))
        unexpected = [n for n in feeds if n not in expected]
        if unexpected:
            raise InputError(f"unexpected input(s) {unexpected}; the model's inputs are {list(expected)}")
        for name, spec in expected.items():
            value = feeds[name]
            if not isinstance(value, np.ndarray):
                raise InputError(f"input '{name}' must be a numpy array, got {type(value).__name__}")
            if tuple(value.shape) != spec.shape:
                raise InputError(f"input '{name}' has shape {list(value.shape)}, expected {list(spec.shape)}")
            if str(value.dtype) != spec.dtype:
                raise InputError(f"input '{name}' has dtype {value.dtype}, expected {spec.dtype}")
            self._input_buffers[name].copyfrom(np.require(value, requirements="C"))  # keeps rank 0
