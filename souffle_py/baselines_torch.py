"""PyTorch baselines for the GPU benchmark: the torch.nn equivalent of a models/ graph run eagerly, captured
in one CUDA graph, or through torch.compile(mode="reduce-overhead").

PyTorch is optional (no dependency of souffle-py): this module imports without it, torch_available() says
whether it can be used, and building a TorchModel without it raises a SouffleError. The torch.nn models
and their weight loading live in models/torch_equivalents/.
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Callable, Mapping

import numpy as np
import onnx

from models.torch_equivalents import model_name, require_torch, torch_equivalent
from souffle_py.errors import InputError, SouffleError

MODES = ("eager", "graph", "compile")
SYSTEM_NAMES = {"eager": "PyTorch eager", "graph": "PyTorch CUDA graph",
                "compile": "PyTorch torch.compile (reduce-overhead)"}
DTYPES = ("float32", "float16", "bfloat16")
# Untimed calls before a CUDA graph capture (cuDNN/cuBLAS choose algorithms and allocate workspaces) and
# at construction under torch.compile (reduce-overhead compiles on the 1st call, records its CUDA graph on
# the 2nd and replays from the 3rd), so that neither happens inside a timed run.
CAPTURE_WARMUP = 3
COMPILE_WARMUP = 3


def torch_available() -> bool:
    """Whether PyTorch imports here (a broken install counts as absent)."""
    try:
        require_torch()
    except SouffleError:
        return False
    return True


def disable_tf32() -> None:
    """Keep float32 matmuls and convolutions in full float32, as ONNX Runtime and souffle-py compute them.

    These are process-wide PyTorch settings; TF32 would make PyTorch faster and miss the 1e-4 tolerance.
    """
    torch = require_torch()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


class TorchModel:
    """The torch.nn equivalent of a models/ ONNX graph with the run()/benchmark() interface of CompiledModel.

    mode: "eager" runs the module op by op; "graph" captures one inference into a torch.cuda.CUDAGraph at
    construction (static input and output tensors: inputs are copied in, the graph replayed); "compile" runs
    torch.compile(module, mode="reduce-overhead", dynamic=False), compiled (and, on CUDA, graph-recorded) at
    construction; dynamic=False keeps each model's kernels specialized to its shapes when several models of
    one class are compiled in one process. nn.LSTM is not traced by torch.compile (TorchDynamo's allow_rnn
    is off by default), so the LSTM's compiled mode runs the same cuDNN LSTM as eager.
    Inputs and outputs are the ONNX graph's, by name; outputs come back as float32 numpy arrays. With a
    dtype other than float32 the module computes in that type (inputs are cast), so results drift from ONNX
    Runtime's beyond the benchmark's 1e-4 tolerance.

    benchmark() measures host wall-clock time per inference with torch.cuda.synchronize() after each
    (launch overhead included, as for souffle-py's own CompiledModel), inputs already on the device and
    outputs left there. num_kernels is None: kernel launches are not counted.
    """

    def __init__(self, proto: onnx.ModelProto, mode: str = "eager", device: str = "cuda", dtype: str = "float32"):
        torch = require_torch()
        if mode not in MODES:
            raise SouffleError(f"unknown PyTorch mode {mode!r}; expected one of {', '.join(MODES)}")
        if dtype not in DTYPES:
            raise SouffleError(f"unsupported dtype {dtype!r} for the PyTorch baseline; expected one of "
                               f"{', '.join(DTYPES)}")
        self.model = model_name(proto)
        self.mode = mode
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise SouffleError(f"PyTorch {torch.__version__} sees no CUDA device (a CPU-only build, or no GPU)")
        if mode == "graph" and self.device.type != "cuda":
            raise SouffleError(f"a CUDA graph needs a CUDA device, not {device!r}; use mode='eager' or 'compile'")
        start = time.perf_counter()
        disable_tf32()
        self._torch = torch
        self.dtype = getattr(torch, dtype)
        initializers = {t.name for t in proto.graph.initializer}
        self.inputs = tuple((i.name, tuple(d.dim_value for d in i.type.tensor_type.shape.dim),
                             onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type))
                            for i in proto.graph.input if i.name not in initializers)
        self.output_names = tuple(o.name for o in proto.graph.output)
        self.num_kernels = None
        self.module = torch_equivalent(proto).to(self.device, self.dtype)
        self._inputs = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _, shape, _ in self.inputs]
        self._forward = self._prepare()
        self.compile_seconds = time.perf_counter() - start

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Outputs by name for one inference on `feeds` (input name -> array of the declared shape and dtype)."""
        self._load(feeds)
        with self._torch.no_grad():
            outputs = self._forward()
            return {name: out.detach().to("cpu", self._torch.float32, copy=True).numpy()
                    for name, out in zip(self.output_names, outputs)}

    def benchmark(self, feeds: Mapping[str, np.ndarray], repeat: int = 10, warmup: int = 2) -> dict[str, float]:
        """Latency of one inference in ms (wall clock, synchronized): median, min and max over `repeat` runs."""
        self._load(feeds)
        times = []
        with self._torch.no_grad():
            for _ in range(warmup):
                self._forward()
            self._synchronize()
            for _ in range(repeat):
                start = time.perf_counter()
                self._forward()
                self._synchronize()
                times.append((time.perf_counter() - start) * 1e3)
        return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times),
                "repeat": repeat, "times_ms": times}

    def _prepare(self) -> Callable[[], tuple]:
        """The per-inference call of this mode, reading the static input tensors; compiles or captures now."""
        torch = self._torch
        if self.mode == "eager":
            return lambda: _as_tuple(self.module(*self._inputs))
        try:
            with torch.no_grad():
                if self.mode == "graph":
                    return self._capture_cuda_graph()
                compiled = torch.compile(self.module, mode="reduce-overhead", dynamic=False)

                def forward():
                    torch.compiler.cudagraph_mark_step_begin()  # the previous outputs are consumed
                    return _as_tuple(compiled(*self._inputs))

                for _ in range(COMPILE_WARMUP):
                    forward()
                self._synchronize()
                return forward
        except Exception as exc:  # report it as one failed benchmark row rather than end the benchmark
            what = "CUDA graph capture" if self.mode == "graph" else "torch.compile"
            raise SouffleError(f"PyTorch {what} failed on {self.model}: {str(exc).splitlines()[0][:200]}") from exc

    def _capture_cuda_graph(self) -> Callable[[], tuple]:
        """Capture one inference on the static inputs; replaying it rewrites the same output tensors."""
        torch = self._torch
        side = torch.cuda.Stream()  # warm up off the default stream, as torch.cuda.graph requires
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(CAPTURE_WARMUP):
                self.module(*self._inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = _as_tuple(self.module(*self._inputs))
        self._graph = graph  # the graph and its memory pool must outlive this call

        def replay():
            graph.replay()
            return outputs

        return replay

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            self._torch.cuda.synchronize(self.device)

    def _load(self, feeds: Mapping[str, np.ndarray]) -> None:
        """Check `feeds` against the ONNX inputs and copy them into the static input tensors."""
        if not isinstance(feeds, Mapping):
            raise InputError(f"feeds must be a dict of input name -> numpy array, got {type(feeds).__name__}")
        names = [name for name, _, _ in self.inputs]
        missing, unexpected = [n for n in names if n not in feeds], [n for n in feeds if n not in names]
        if missing or unexpected:
            raise InputError(f"{self.model}: missing input(s) {missing}, unexpected input(s) {unexpected}; "
                             "the model expects " + ", ".join(f"'{n}' {list(s)} {d}" for n, s, d in self.inputs))
        for (name, shape, dtype), target in zip(self.inputs, self._inputs):
            value = feeds[name]
            if not isinstance(value, np.ndarray):
                raise InputError(f"input '{name}' must be a numpy array, got {type(value).__name__}")
            if tuple(value.shape) != shape:
                raise InputError(f"input '{name}' has shape {list(value.shape)}, expected {list(shape)}")
            if value.dtype != dtype:
                raise InputError(f"input '{name}' has dtype {value.dtype}, expected {dtype}")
            target.copy_(self._torch.from_numpy(np.ascontiguousarray(value)))


def _as_tuple(outputs) -> tuple:
    return outputs if isinstance(outputs, tuple) else (outputs,)


def torch_systems(device: str = "cuda") -> dict[str, Callable[[onnx.ModelProto], TorchModel]]:
    """Benchmark system name -> factory(proto) -> TorchModel, for souffle_py.benchmark.measure().

    The CUDA graph system is only offered for a CUDA device. Raises a SouffleError without PyTorch.
    """
    require_torch()
    modes = MODES if device.startswith("cuda") else tuple(m for m in MODES if m != "graph")
    return {SYSTEM_NAMES[mode]: functools.partial(TorchModel, mode=mode, device=device) for mode in modes}
