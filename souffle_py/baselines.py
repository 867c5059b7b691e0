"""Reference points for tests and benchmarks: ONNX Runtime and unfused TVM.

ONNX Runtime is the numerical oracle and the peer to beat; "unfused TVM" is souffle-py's own TE lowering
with every TE its own kernel and the default schedules, i.e. what the compiler starts from.
"""

from __future__ import annotations

import statistics
import time
from typing import Mapping, Sequence

import numpy as np
import onnx

from souffle_py.api import build_model
from souffle_py.codegen.kernels import unfused_kernels
from souffle_py.frontend import load_model, lower
from souffle_py.runtime import CompiledModel
from souffle_py.target import num_threads, resolve_target


class OnnxRuntimeModel:
    """An ONNX Runtime CPU session with the same run()/benchmark() interface as CompiledModel."""

    def __init__(self, model, threads: int | None = None, optimize: bool = True):
        import onnxruntime as ort

        proto = model if isinstance(model, onnx.ModelProto) else onnx.load(model)
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads or num_threads()
        options.inter_op_num_threads = 1
        if not optimize:
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        self.session = ort.InferenceSession(proto.SerializeToString(), options,
                                            providers=["CPUExecutionProvider"])
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.num_kernels = len(proto.graph.node)  # nodes before ORT's own fusion; a rough reference only

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(self.output_names, self.session.run(None, dict(feeds))))

    def benchmark(self, feeds: Mapping[str, np.ndarray], repeat: int = 10, warmup: int = 2) -> dict[str, float]:
        for _ in range(warmup):
            self.session.run(None, dict(feeds))
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            self.session.run(None, dict(feeds))
            times.append((time.perf_counter() - start) * 1e3)
        return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times),
                "repeat": repeat}


def unfused_tvm(model, target="llvm", input_shapes: Mapping[str, Sequence[int]] | None = None) -> CompiledModel:
    """Every TE its own kernel, default schedules: the starting point souffle-py's passes improve on."""
    start = time.perf_counter()
    program = lower(load_model(model, input_shapes))
    return build_model(program, unfused_kernels(program), resolve_target(target), start)
