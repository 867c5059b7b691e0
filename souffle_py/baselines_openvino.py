"""OpenVINO on the CPU as a baseline, with the run()/benchmark() interface of CompiledModel.

Intel's runtime compiles the ONNX graph with its own fusions and oneDNN kernels; on the CPU its default
precision hint may compute in bf16 where the cores have it (these Zen 5 cores do), so the baseline pins
the float32 hint: the same arithmetic as souffle-py and ONNX Runtime. Optional (the `openvino` extra):
`available()` says whether it can be imported.
"""

from __future__ import annotations

import statistics
import time
from typing import Mapping

import numpy as np
import onnx

from souffle_py.errors import SouffleError
from souffle_py.target import num_threads


def available() -> bool:
    try:
        import openvino  # noqa: F401
    except ImportError:
        return False
    return True


class OpenVinoModel:
    """An OpenVINO CPU model compiled with the float32 precision hint on `threads` threads (latency mode)."""

    def __init__(self, model, threads: int | None = None):
        import openvino as ov

        core = ov.Core()
        try:
            source = core.read_model(model) if not isinstance(model, onnx.ModelProto) else \
                core.read_model(model.SerializeToString(), b"")
            self.compiled = core.compile_model(source, "CPU", {
                "INFERENCE_NUM_THREADS": threads or num_threads(), "INFERENCE_PRECISION_HINT": "f32",
                "PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": 1})
        except Exception as exc:  # OpenVINO's conversion or compile failure, reported as a row
            raise SouffleError(f"OpenVINO could not compile the model: {str(exc).strip().splitlines()[0][:200]}") \
                from exc
        self.request = self.compiled.create_infer_request()
        self.output_names = [o.get_any_name() for o in self.compiled.outputs]
        self.num_kernels = None

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        results = self.request.infer(dict(feeds))
        return {name: np.array(results[output]) for name, output in zip(self.output_names, self.compiled.outputs)}

    def benchmark(self, feeds: Mapping[str, np.ndarray], repeat: int = 10, warmup: int = 2) -> dict[str, float]:
        inputs = dict(feeds)
        for _ in range(warmup):
            self.request.infer(inputs)
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            self.request.infer(inputs)
            times.append((time.perf_counter() - start) * 1e3)
        return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times),
                "repeat": repeat, "times_ms": times}
