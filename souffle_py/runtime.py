"""CompiledModel: the executable form of a model, from an execution plan (plan.py), a built library and
the weights. Weights are uploaded once; inputs, intermediates and outputs live in workspaces (workspace.py),
one per run() in flight, so that many threads can run one model at once; inputs and outputs are copied
per run().

The device is touched only when the model first runs, so a model compiled for a GPU on a machine without
one can still be described, inspected and exported; running it there raises NoDeviceError.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from souffle_py.cpu_features import check_runnable
from souffle_py.export import export_model, read_model
from souffle_py.errors import InputError, KernelFitError, SouffleError
from souffle_py.launch_check import LaunchChecker
from souffle_py.memory import itemsize, memory_for
from souffle_py.plan import ONE_THREAD_NOTE, ExecutionPlan, operations_text
from souffle_py.workspace import Workspace, WorkspacePool, check_out, workspace_bytes

REDUCED = {"bf16": "bfloat16", "fp16": "float16"}  # a plan's reduced precision: its GEMM operands' type


@dataclass(frozen=True)
class InputSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str


class CompiledModel:
    """Run a compiled model: `run(feeds) -> outputs`, `benchmark()`, `describe()`, `export(path)`,
    `device_source()`, `num_kernels`."""

    def __init__(self, plan: ExecutionPlan, module, params: Mapping[str, np.ndarray], *, kernels=(),
                 program=None, compile_seconds: float = 0.0, device_source: str = "", device_binary: bytes = b"",
                 target_description: str = "", scheduled_functions=None):
        self.plan = plan
        self._module = module            # the built library (an Executable, a Module, or a loader of one)
        self.params = dict(params)
        self.kernels = tuple(kernels)    # the Kernel objects, when compiled in this process
        self.scheduled_functions = dict(scheduled_functions or {})  # their scheduled PrimFuncs, by symbol
        self.program = program
        self.compile_seconds = compile_seconds
        self.distinct_kernels = plan.distinct
        self.target_description = target_description or plan.target_description or json.loads(plan.target)["kind"]
        self._device_source = device_source
        self._device_binary = device_binary
        self._device = None
        self.inputs = tuple(InputSpec(name, tuple(plan.buffer(b).shape), plan.buffer(b).dtype) for name, b in plan.inputs)
        self.output_names = tuple(name for name, _ in plan.outputs)
        self._feed_specs = tuple((s.name, s.shape, np.dtype(s.dtype)) for s in self.inputs)
        self._output_specs = tuple(plan.buffer(b) for _, b in plan.outputs)
        self._setup_lock = threading.Lock()
        self._pool: WorkspacePool | None = None
        self.cached = False  # loaded from the compile cache by optimize() (compile_cache.py)
        # weights uploaded once for several models that hold the same arrays (a dynamic model's shapes,
        # dynamic.py): (id of the array, dtype, shape, device) -> tensor; None: this model's own
        self.shared_uploads: dict | None = None

    @property
    def target(self):
        """The TVM target compiled for (imports tvm: a model only run never needs it)."""
        import tvm

        return tvm.target.Target(json.loads(self.plan.target))

    # --- the device, set up on first use -------------------------------------------------------------------
    @property
    def device(self):
        if self._device is None:
            self._setup()
        return self._device

    def _setup(self) -> None:
        """Upload the weights and make the workspace pool, once (concurrent first calls wait for it)."""
        with self._setup_lock:
            if self._device is not None:
                return
            if self.plan.device == "cpu":  # a library built for another CPU would die of SIGILL
                check_runnable(self.plan.arch, self.plan.cpu_features, "this model's library")
            memory = memory_for(self.plan.device)
            self._check_grids(memory.device)
            library = self.library()
            module = library.mod if hasattr(library, "mod") else library
            params = {spec.name: self._uploaded(spec, memory) for spec in self.plan.buffers if spec.role == "param"}
            functions = {call.function: module[call.function] for call in self.plan.calls}
            self._pool = WorkspacePool(lambda: Workspace(self.plan, functions, params, memory))
            self._pool.give(self._pool.take())  # the first workspace now: a failure surfaces at setup
            # the first run synchronizes after each call: a device error names its kernel (launch_check.py)
            self._checker = LaunchChecker([call.name for call in self.plan.calls], memory.sync, self.plan.device)
            self._memory = memory
            self._device = memory.device

    def _uploaded(self, spec, memory):
        values = self.params[spec.name]
        if self.shared_uploads is None:
            return _uploaded(values, spec, memory)
        key = (id(values), spec.dtype, tuple(spec.shape), self.plan.device)
        tensor = self.shared_uploads.get(key)
        if tensor is None:  # two models setting up at once may both upload; one tensor is kept
            tensor = self.shared_uploads.setdefault(key, _uploaded(values, spec, memory))
        return tensor

    @contextmanager
    def workspace(self):
        """A workspace of this model's own for the duration of the block (workspace.py): its buffers and
        kernel calls, for timing and inspection; run() takes one the same way."""
        if self._device is None:
            self._setup()
        ws = self._pool.take()
        try:
            yield ws
        finally:
            self._pool.give(ws)

    def _check_grids(self, device) -> None:
        """Refuse a cooperative grid the present GPU cannot keep resident (CUDA would fail without a
        message, or hang on the grid barrier) before anything launches."""
        cooperative = [(call, l) for call in self.plan.calls for l in call.launches if l.cooperative]
        if not cooperative:
            return
        sms = int(device.multi_processor_count)
        for call, launch in cooperative:
            if launch.blocks > sms * (launch.resident_blocks_per_sm or 0):
                raise KernelFitError(
                    f"kernel '{launch.kernel}' ({call.name}) is a grid-synchronized launch of {launch.blocks} "
                    f"blocks, but this GPU keeps at most {sms} SMs x {launch.resident_blocks_per_sm} blocks "
                    f"resident: recompile for it (target='cuda' on this machine)")

    @property
    def workspace_bytes(self) -> int:
        """Device memory of one workspace (inputs, intermediates, outputs): each call in flight holds one."""
        return workspace_bytes(self.plan)

    @property
    def num_kernels(self) -> int:
        """Device kernel launches per inference (on the CPU: kernel function calls)."""
        return self.plan.device_launches

    @property
    def single_threaded(self) -> bool:
        """Whether every kernel was scheduled for one thread (a CPU model of little work): its rate is
        rated against one core's peak."""
        return ONE_THREAD_NOTE in self.plan.notes

    @property
    def grid_syncs(self) -> int:
        """Grid-wide barriers per inference (GPU grid-synchronized kernels)."""
        return sum(l.grid_syncs * l.launches_per_call for c in self.plan.calls for l in c.launches)

    # --- running ---------------------------------------------------------------------------------------------
    def run(self, feeds: Mapping[str, np.ndarray], out: Mapping[str, np.ndarray] | None = None
            ) -> dict[str, np.ndarray]:
        """Outputs by name for one inference on `feeds` (input name -> array of the declared shape and dtype).
        Safe to call from many threads at once: each call runs in a workspace of its own (workspace.py).
        The arrays returned are the caller's (a later call never writes them); `out` (output name -> array
        of that output's shape and dtype) has outputs written into arrays the caller owns instead."""
        if self._device is None:
            self._setup()
        ws = self._pool.take()
        try:
            if type(feeds) is not dict or len(feeds) != len(self._feed_specs) or not ws.load(feeds, self._feed_specs):
                self._check(feeds)  # names what does not fit (raises InputError)
                with self._checker.guard("copying the inputs"):
                    self._load(ws, feeds)
            self._checker.run(ws.calls)
            if out is not None:
                check_out(out, self.output_names, self._output_specs)
            if self.plan.device == "cpu":  # no asynchronous device error can surface in a host copy
                return ws.results(self.output_names, out)
            with self._checker.guard("copying the outputs"):
                return ws.results(self.output_names, out)
        finally:
            self._pool.give(ws)

    def benchmark(self, feeds: Mapping[str, np.ndarray] | None = None, repeat: int = 10,
                  warmup: int = 2) -> dict[str, float]:
        """Latency of one inference's kernels in ms (median, min, max over `repeat` runs), inputs already on
        the device. On a GPU each run is timed between two device synchronizations, so it is the device
        time of the inference including its launches, as an application sees it."""
        _check_counts(repeat=repeat, warmup=warmup)
        feeds = feeds if feeds is not None else self.random_feeds()
        self._check(feeds)
        with self.workspace() as ws:
            self._load(ws, feeds)
            execute = lambda: self._checker.run(ws.calls)  # noqa: E731
            for _ in range(warmup):
                execute()
            times = [self._timed_ms(execute) for _ in range(repeat)]
        return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times),
                "repeat": repeat, "times_ms": times}

    def profile(self, feeds: Mapping[str, np.ndarray] | None = None, repeat: int = 10,
                stages: bool = False) -> list[dict]:
        """Where an inference's time goes: each kernel call's median ms within `repeat` whole inferences
        (`median_ms`, each call between two device syncs, in the order the model runs them), with its share
        of their sum, and its median ms run `repeat` times alone (`alone_ms`: its inputs and weights then
        stay in cache, so the gap between the two is what the call loses to memory in a real inference;
        ResNeXt-101's 1x1 convs on the CPU lose 15-35% streaming their weights), and its arithmetic rate
        within inferences (`gflop_s`, from `flops`: the operations of its TEs). Slowest first.
        stages=True (CPU, compiled in this process): each row also lists its `stages`, the kernel's loop
        nests timed inside it with their TEs, ONNX nodes, schedule rule and rate, their sum (`stages_ms`),
        the instrumented call's time and the call's own in alternating inferences (`instrumented_ms`,
        `paired_ms`; stage_profile.py)."""
        _check_counts(repeat=repeat)
        feeds = feeds if feeds is not None else self.random_feeds()
        self._check(feeds)
        with self.workspace() as ws:
            self._load(ws, feeds)
            self._checker.run(ws.calls)
            in_sequence: list[list[float]] = [[] for _ in ws.calls]
            for _ in range(repeat):
                for times, (func, args) in zip(in_sequence, ws.calls):
                    times.append(self._timed_ms(lambda: func(*args)))
            alone = [[self._timed_ms(lambda: func(*args)) for _ in range(repeat)] for func, args in ws.calls]
        rows = []
        for call, alone_ms, times in zip(self.plan.calls, alone, in_sequence):
            median = statistics.median(times)
            rows.append({"kernel": call.name, "function": call.function, "tes": len(call.stages),
                         "median_ms": median, "alone_ms": statistics.median(alone_ms), "flops": call.flops,
                         "gflop_s": call.flops / median / 1e6 if median > 0 else 0.0})
        if stages:
            from souffle_py.stage_profile import profile_stages

            for r, (groups, instrumented_ms, paired_ms) in zip(rows, profile_stages(self, feeds, repeat)):
                r.update(stages=groups, stages_ms=sum(g["median_ms"] for g in groups), instrumented_ms=instrumented_ms,
                         paired_ms=paired_ms)
        total = sum(r["median_ms"] for r in rows) or 1.0
        for r in rows:
            r["share"] = r["median_ms"] / total
        return sorted(rows, key=lambda r: -r["median_ms"])

    def _timed_ms(self, work) -> float:
        """Milliseconds of `work` between two device synchronizations."""
        with self._checker.guard("a device synchronization"):
            self._memory.sync()
            start = time.perf_counter()
            work()
            self._memory.sync()
        return (time.perf_counter() - start) * 1e3

    @staticmethod
    def format_profile(rows: list[dict], top: int | None = None, peak_gflops: float | None = None,
                       top_stages: int | None = 8) -> str:
        """The profile as a table (`top` slowest calls, default all; under each, its `top_stages` slowest
        stages where the profile has them). With the target's `peak_gflops`
        (`Backend.peak_gflops()`), each call's share of that peak, and the compute floor: the inference's
        operations at the peak, the time no schedule can beat."""
        def rate(flops: float, ms: float) -> str:
            if not flops or ms <= 0:
                return f"{'':>9}" + (f" {'':>6}" if peak_gflops else "")
            gflop_s = flops / ms / 1e6
            return f"{gflop_s:>9.1f}" + (f" {gflop_s / peak_gflops:>6.0%}" if peak_gflops else "")
        rate_header = f"{'GFLOP/s':>9}" + (f" {'peak':>6}" if peak_gflops else "")
        lines = [f"{'kernel':<40} {'TEs':>5} {'ms':>9} {'share':>7} {'alone ms':>9} {rate_header}"]
        for r in rows[:top]:
            lines.append(f"{r['kernel'][:40]:<40} {r['tes']:>5} {r['median_ms']:>9.3f} {r['share']:>6.1%} "
                         f"{r['alone_ms']:>9.3f} {rate(r.get('flops', 0), r['median_ms'])}")
            if "stages" in r:
                from souffle_py.stage_profile import stage_lines

                lines += stage_lines(r, peak_gflops, top_stages)
        total_ms, flops = sum(r["median_ms"] for r in rows), sum(r.get("flops", 0) for r in rows)
        lines.append(f"{'total (kernels within inferences)':<40} {'':>5} {total_ms:>9.3f} "
                     f"{'':>7} {sum(r['alone_ms'] for r in rows):>9.3f} {rate(flops, total_ms)}")
        if peak_gflops and flops:
            lines.append(f"measured peak {peak_gflops:.1f} GFLOP/s: {operations_text(flops)} per inference take "
                         f"at least {flops / peak_gflops / 1e6:.3g} ms ({flops / peak_gflops / 1e6 / total_ms:.0%} "
                         f"of the total)")
        return "\n".join(lines)

    def random_feeds(self, seed: int = 0) -> dict[str, np.ndarray]:
        return self.plan.random_feeds(seed)

    def _load(self, ws: Workspace, feeds) -> None:
        """Copy checked `feeds` into `ws` (any mapping, any array layout): through the buffers' numpy views
        on the CPU (a model loaded without the compiler has tvm_ffi tensors, which have no copyfrom)."""
        for (name, _, _), view, buffer in zip(self._feed_specs, ws.input_views, ws.input_buffers):
            value = np.require(feeds[name], requirements="C")  # keeps rank 0
            if view is None:
                buffer.copyfrom(value)
            elif value.shape != view.shape:
                raise InputError(f"input '{name}' has shape {list(value.shape)}; the model expects "
                                 f"{list(view.shape)}")
            else:
                np.copyto(view, value, casting="same_kind")

    def _check(self, feeds) -> None:
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
            if tuple(value.shape) != tuple(spec.shape):
                raise InputError(f"input '{name}' has shape {list(value.shape)}, expected {list(spec.shape)}")
            if str(value.dtype) != spec.dtype:
                raise InputError(f"input '{name}' has dtype {value.dtype}, expected {spec.dtype}")

    # --- inspection and export -------------------------------------------------------------------------------
    def describe(self) -> str:
        """One entry per kernel call: its function, TEs and ONNX nodes, cut reason and, on a GPU, each device
        kernel's launch (blocks x threads, launches per call) and resources (registers, shared memory)."""
        plan = self.plan
        lines = [f"{len(plan.calls)} kernel calls ({self.num_kernels} device kernel launches per inference), "
                 f"{plan.distinct} distinct kernels, target {self.target_description}, precision {plan.precision}"
                 + (f" (GEMM operands {REDUCED[plan.precision]}, float32 accumulation)"
                    if plan.precision in REDUCED else "")]
        if plan.device == "cuda":
            from souffle_py.backends.cuda.report import grid_figures
            lines.append(f"  {grid_figures(plan).line()}")
        for i, call in enumerate(plan.calls):
            lines.append(f"  [{i:4d}] {call.name}: {len(call.stages)} TEs from {len(call.nodes)} ONNX nodes"
                         + (f" -- {call.reason}" if call.reason else ""))
            lines.append(f"         TEs: {', '.join(call.stages)}")
            lines.append(f"         ONNX nodes: {', '.join(call.nodes)}")
            if call.time_loops:
                where = ("each step reads the previous one in place" if plan.device != "cuda" else
                         "inside the kernel, a grid barrier per step" if any(l.cooperative for l in call.launches)
                         else "host loop of kernel launches")
                lines.append(f"         time loops: {call.time_loops} (recurrences; {where})")
            for launch in call.launches:
                resources = (f", {launch.registers} registers/thread, {launch.shared_bytes} B shared/block"
                             + (f", {launch.spill_bytes} B spilled" if launch.spill_bytes else "")
                             + f" [{launch.resources_from}]") if launch.registers is not None else ""
                times = f" x {launch.launches_per_call} launches" if launch.launches_per_call > 1 else ""
                grid = (f"; cooperative, {launch.grid_syncs} grid syncs, {launch.resident_blocks_per_sm} "
                        f"resident blocks/SM" if launch.cooperative else "")
                grid += f"; {launch.warp_reductions} warp reductions" if launch.warp_reductions else ""
                for source in sorted({source for _, source in launch.stage_schedules}):
                    stages = [call.stages[i] for i, s in launch.stage_schedules if s == source]
                    grid += f"\n           {len(stages)} GEMM stages on their own {source} schedules: {', '.join(stages)}"
                lines.append(f"         {launch.kernel}: {launch.blocks} blocks x {launch.threads} threads"
                             f"{times}{resources}{grid}")
        lines += [f"  note: {note}" for note in plan.notes]
        return "\n".join(lines)

    def library(self):
        """The built library (loaded on first use for an exported model)."""
        if callable(self._module) and not hasattr(self._module, "export_library"):
            self._module = self._module()
        return self._module

    def device_binary(self) -> bytes:
        """The nvcc-compiled device binary of a GPU model (b"" on the CPU)."""
        return self._device_binary

    def device_source(self) -> str:
        """The generated CUDA C of a GPU model (available without a GPU)."""
        if self.plan.device == "cpu":
            raise SouffleError("device_source() is the CUDA C of a GPU model; this model was compiled for the CPU "
                               "(its kernels are LLVM functions in the built library)")
        return self._device_source

    def export(self, path) -> None:
        """Write the model as one file (the built library, the plan and the weights): see souffle_py.load."""
        export_model(self, path)


def load(path, check_cpu: bool = True, verify: bool = True) -> CompiledModel:
    """A CompiledModel from a file written by CompiledModel.export (or `souffle compile -o`). A CUDA model
    loads anywhere (describe, device_source); running it needs a GPU. A CPU library built for a CPU this one
    cannot run is a TargetError here, unless check_cpu is False (the compile cache: run() still refuses)."""
    return compiled_from(read_model(path, check_cpu, verify))


def compiled_from(exported) -> CompiledModel:
    """The CompiledModel of an export's checked parts (export.ExportedModel)."""
    model = CompiledModel(exported.plan, exported.load_library, exported.params,
                          device_source=exported.device_source, device_binary=exported.device_binary)
    model._keep_alive = exported.keep_alive  # the extracted library lives as long as the model
    return model


def _check_counts(**counts) -> None:
    for name, value in counts.items():
        minimum = 0 if name == "warmup" else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise InputError(f"{name} must be an integer of at least {minimum}, got {value!r}")


def _uploaded(values: np.ndarray, spec, memory):
    """A constant on the device. numpy has no bfloat16: a bfloat16 weight (te_passes/precision.py) is kept as
    its uint16 bits (or, from an exported file, as 2-byte void items) and copied bit for bit."""
    if str(values.dtype) != spec.dtype and values.dtype.itemsize != itemsize(spec.dtype):
        raise ValueError(f"constant {spec.name}: {values.dtype} values for a {spec.dtype} buffer")
    return memory.upload(values, spec.shape, spec.dtype)
