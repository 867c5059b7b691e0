"""Reference points for tests and benchmarks: ONNX Runtime, unfused TVM and TVM Relax.

ONNX Runtime is the numerical oracle and the peer to beat; "unfused TVM" is souffle-py's own TE lowering
with every TE its own kernel and the target's default schedules, i.e. what the compiler starts from; "TVM
Relax" is TVM's own importer and operator fusion: on the CPU optionally with the same MetaSchedule budget
souffle-py gets, on CUDA its default pipeline (FuseOps/FuseTIR and dlight), with or without CUDA graphs.
PyTorch's eager, CUDA-graph and torch.compile baselines are in baselines_torch.py.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from typing import Mapping, Sequence

import numpy as np
import onnx
import tvm
from tvm import relax
from tvm.relax.backend.cpu_generic import pipeline as cpu_pipeline  # its __init__ omits dataflow_lower_passes
from tvm.relax.frontend.onnx import from_onnx

from souffle_py.assemble import build_model
from souffle_py.passes import prepared
from souffle_py.backends import backend_for
from souffle_py.devices import device_for
from souffle_py.errors import SouffleError
from souffle_py.frontend import load_model, lower
from souffle_py.runtime import CompiledModel
from souffle_py.schedule.tuning import default_database_dir, open_database, tune
from souffle_py.host import num_threads


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
                "repeat": repeat, "times_ms": times}


def unfused_tvm(model, target="llvm", input_shapes: Mapping[str, Sequence[int]] | None = None,
                fast_math: bool = True) -> CompiledModel:
    """Every TE its own kernel, the target's default schedules with the same weight layout and fast math:
    the starting point souffle-py's passes improve on."""
    start = time.perf_counter()
    backend = backend_for(target)
    program = prepared(lower(load_model(model, input_shapes)), backend, passes="V0", merge=False)
    kernels = backend.unfused_kernels(program, fast_math)
    return build_model(program, kernels, backend, backend.default_scheduler(kernels), start, fast_math)


class RelaxModel:
    """A TVM Relax VM with the run()/benchmark() interface of CompiledModel."""

    def __init__(self, executable, device_kind: str, input_names: Sequence[str], output_names: Sequence[str],
                 num_kernels: int):
        self.executable = executable
        self.device = device_for(device_kind)  # a NoDeviceError for CUDA without a GPU
        self.vm = relax.VirtualMachine(executable, self.device)
        self.input_names = tuple(input_names)
        self.output_names = tuple(output_names)
        self.num_kernels = num_kernels  # PrimFunc calls per inference

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = self.vm["main"](*self._args(feeds))
        outputs = [out] if isinstance(out, tvm.runtime.Tensor) else list(out)
        return {name: o.numpy() for name, o in zip(self.output_names, outputs)}

    def benchmark(self, feeds: Mapping[str, np.ndarray], repeat: int = 10, warmup: int = 2) -> dict[str, float]:
        args = self._args(feeds)
        for _ in range(warmup):
            self.vm["main"](*args)
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            self.vm["main"](*args)
            self.device.sync()
            times.append((time.perf_counter() - start) * 1e3)
        return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times),
                "repeat": repeat, "times_ms": times}

    def _args(self, feeds):
        return [tvm.runtime.tensor(np.ascontiguousarray(feeds[name]), self.device) for name in self.input_names]


def _relax_import(model, input_shapes):
    """(proto, Relax module, graph input names) from TVM's Relax ONNX importer."""
    proto = model if isinstance(model, onnx.ModelProto) else onnx.load(model)
    initializers = {t.name for t in proto.graph.initializer}
    input_names = [i.name for i in proto.graph.input if i.name not in initializers]
    try:
        mod = from_onnx(proto, shape_dict=dict(input_shapes or {}))
    except Exception as exc:
        raise SouffleError(f"TVM's Relax ONNX importer cannot convert this model: {exc}") from exc
    return proto, mod, input_names


def relax_tvm(model, target="llvm", trials: int = 0, database_dir=None,
              input_shapes: Mapping[str, Sequence[int]] | None = None, quiet: bool = False,
              cuda_graph: bool = False) -> RelaxModel:
    """TVM's own pipeline: Relax ONNX import, FuseOps/FuseTIR, and then
    - CPU: MetaSchedule on the fused TIR when trials > 0. Untuned, this is what `relax.get_default_pipeline`
      builds for the CPU (TIR loops as legalized, no schedules). With trials (or an existing database_dir)
      the fused PrimFuncs are tuned into the same kind of database souffle-py uses and applied with
      MetaScheduleApplyDatabase; the rest stay unscheduled, as in TVM's own tuning flow. The VM runs on
      TVM_NUM_THREADS threads, which souffle-py sets to every core.
    - CUDA: its default CUDA pipeline (dlight's default GPU rules), `cuda_graph` its CUDA-graph option
      (relax.backend.use_cuda_graph). Compiling needs no GPU; running does.
    """
    backend = backend_for(target)
    tvm_target = backend.target
    if backend.device == "cuda":
        if trials:
            raise SouffleError("the TVM Relax CUDA baseline is its default (dlight) pipeline; it is not tuned")
        return _relax_cuda(model, tvm_target, input_shapes, cuda_graph)
    proto, mod, input_names = _relax_import(model, input_shapes)
    with tvm_target:  # relax.get_default_pipeline(llvm) in two halves, to tune the fused TIR in between
        mod = tvm.transform.Sequential(cpu_pipeline.library_dispatch_passes(tvm_target)
                                       + cpu_pipeline.legalize_passes(tvm_target))(mod)  # ends with FuseOps, FuseTIR
    database_dir = database_dir if database_dir is not None or not trials else default_database_dir()
    if database_dir is not None:
        funcs = {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}
        tune(funcs, tvm_target, database_dir, trials, weights=_tir_calls(mod), quiet=quiet)
        with tvm_target, open_database(database_dir, tvm_target):
            mod = relax.transform.MetaScheduleApplyDatabase()(mod)
    with tvm_target:
        mod = tvm.transform.Sequential(cpu_pipeline.dataflow_lower_passes(tvm_target)
                                       + cpu_pipeline.finalize_passes(tvm_target))(mod)
    executable = tvm.compile(mod, tvm_target, relax_pipeline=None)
    return RelaxModel(executable, "cpu", input_names, [o.name for o in proto.graph.output],
                      num_kernels=sum(_tir_calls(mod).values()))


def _relax_cuda(model, tvm_target, input_shapes, cuda_graph: bool) -> "RelaxModel":
    from souffle_py.backends.cuda.nvcc import install_callback

    install_callback()  # TVM keeps CUDA as source and compiles at load: nvcc, as for souffle-py's kernels
    proto, mod, input_names = _relax_import(model, input_shapes)
    with tvm.transform.PassContext(opt_level=3, config={"relax.backend.use_cuda_graph": cuda_graph}):
        mod = relax.get_default_pipeline(tvm_target)(mod)
        executable = tvm.compile(mod, tvm_target, relax_pipeline=None)
    return RelaxModel(executable, "cuda", input_names, [o.name for o in proto.graph.output],
                      num_kernels=sum(_tir_calls(mod).values()))


def _tir_calls(mod: tvm.IRModule) -> Counter:
    """PrimFunc name -> calls from main (call_tir before lowering, direct calls after; reshapes lowered away)."""
    call_tir = tvm.ir.Op.get("relax.call_tir")
    calls = Counter()
    for block in mod["main"].body.blocks:
        for binding in block.bindings:
            value = binding.value
            if not isinstance(value, relax.Call):
                continue
            callee = value.args[0] if value.op.same_as(call_tir) else value.op
            if isinstance(callee, tvm.ir.GlobalVar) and isinstance(mod[callee], tvm.tirx.PrimFunc):
                calls[callee.name_hint] += 1
    return calls


class OpenVinoModel:
    """An OpenVINO CPU compiled model (latency hint, `threads` inference threads) with the run()/benchmark()
    interface of CompiledModel. precision: "f32", or None for OpenVINO's own default (bf16 on a CPU with
    AVX512_BF16 or AMX: the precision a user who installs OpenVINO gets)."""

    def __init__(self, model, threads: int | None = None, precision: str | None = None):
        import openvino as ov

        proto = model if isinstance(model, onnx.ModelProto) else onnx.load(model)
        core = ov.Core()
        config = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": threads or num_threads()}
        if precision is not None:
            config["INFERENCE_PRECISION_HINT"] = precision
        self.compiled = core.compile_model(core.read_model(proto.SerializeToString(), b""), "CPU", config)
        self.precision = str(self.compiled.get_property("INFERENCE_PRECISION_HINT"))
        self.request = self.compiled.create_infer_request()
        # an output tensor has several names in OpenVINO (Swin's "output" is also "head/fc"): the ONNX ones
        self.output_names = [o.name for o in proto.graph.output]
        self._outputs = [next((c for c in self.compiled.outputs if name in c.get_names()), self.compiled.outputs[i])
                         for i, name in enumerate(self.output_names)]
        self.num_kernels = None

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        results = self.request.infer(dict(feeds))
        return {name: np.array(results[output]) for name, output in zip(self.output_names, self._outputs)}

    def benchmark(self, feeds: Mapping[str, np.ndarray], repeat: int = 10, warmup: int = 2) -> dict[str, float]:
        for _ in range(warmup):
            self.request.infer(dict(feeds))
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            self.request.infer(dict(feeds))
            times.append((time.perf_counter() - start) * 1e3)
        return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times),
                "repeat": repeat, "times_ms": times}

    def random_feeds(self, seed: int = 0):
        raise NotImplementedError("OpenVINO rows take the souffle-py model's feeds")


def openvino_available() -> bool:
    """Whether OpenVINO can be imported (the optional `bench` extra)."""
    try:
        import openvino  # noqa: F401
    except ImportError:
        return False
    return True


def openvino_systems(threads: int | None = None) -> dict:
    """Benchmark systems for OpenVINO when it is importable (the optional `bench` extra): its f32 hint and
    its default precision, both CPU, latency hint, `threads` threads; {} without OpenVINO."""
    if not openvino_available():
        return {}
    return {"OpenVINO f32": lambda proto: OpenVinoModel(proto, threads, "f32"),
            "OpenVINO default": lambda proto: OpenVinoModel(proto, threads)}
