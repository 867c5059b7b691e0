"""The execution plan of a compiled model: its buffers, its kernel table and how each kernel launches.

Everything the runtime needs besides the built library and the weights, as plain data, so that a model
can be exported as one file (JSON, never pickle) and run where only TVM's runtime is installed. It also
carries what `describe()` prints: the TEs and ONNX nodes of each kernel, the partitioner's cut reason and,
on a GPU, each device kernel's launch and resources (which bound the grid-synchronized kernels' grids).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import numpy as np

class PlanVersionError(ValueError):
    """A plan written by another version of souffle-py."""


PLAN_VERSION = 2  # 2: the CPU the library was built for, and each exported member's SHA-256


@dataclass(frozen=True)
class BufferSpec:
    """One runtime buffer: role is 'input', 'param', 'output' or 'intermediate'."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    role: str


@dataclass(frozen=True)
class Launch:
    """One device kernel of a kernel function: its grid and block sizes, its launches per call (a host
    loop, such as a recurrence's time loop outside a grid kernel, launches it once per iteration) and what
    ptxas reports for it (`resources_from`; registers per thread, static shared memory per block)."""

    kernel: str
    blocks: int
    threads: int
    launches_per_call: int = 1
    registers: int | None = None
    shared_bytes: int | None = None
    spill_bytes: int | None = None
    resources_from: str = ""
    cooperative: bool = False        # a grid-synchronized kernel: all blocks must be resident at once
    grid_syncs: int = 0              # grid barriers per call
    warp_reductions: int = 0         # stages of a grid kernel reduced by a warp per output (shuffles)
    resident_blocks_per_sm: int | None = None  # the occupancy formula with ptxas's figures (compile target)
    stage_schedules: tuple = ()      # (stage index, where its schedule came from) of a grid kernel's GEMM stages
    grid: bool = False               # every stage of the kernel in one launch nest (backends/cuda/grid.py)


ONE_THREAD_NOTE = "a model of little work: every kernel runs on one thread (schedule/threads.py)"


def operations_text(flops: float) -> str:
    """A count of operations for tables: GFLOP for a model's worth, MFLOP for a tiny one."""
    return f"{flops / 1e9:.2f} GFLOP" if flops >= 1e8 else f"{flops / 1e6:.3g} MFLOP"


@dataclass(frozen=True)
class KernelCall:
    """One call per inference of `function` (a symbol of the built library) on the buffers `args`."""

    name: str
    function: str
    args: tuple[str, ...]
    stages: tuple[str, ...]
    nodes: tuple[str, ...]
    reason: str = ""
    time_loops: int = 0
    launches: tuple[Launch, ...] = ()
    flops: int = 0  # operations on data values per call, from its TEs (a multiply-add counts two)


@dataclass(frozen=True)
class ExecutionPlan:
    target: str                      # the TVM target, as its JSON string
    device: str                      # "cpu" or "cuda"
    inputs: tuple[tuple[str, str], ...]   # (ONNX input name, its buffer), in graph order
    outputs: tuple[tuple[str, str], ...]  # (ONNX output name, buffer holding it), in graph order
    buffers: tuple[BufferSpec, ...]
    calls: tuple[KernelCall, ...]
    distinct: int                    # distinct kernel functions (identical kernels compile once)
    device_binary: str = ""          # CUDA: the sha256 of the device source whose binary ships with the plan
    notes: tuple[str, ...] = field(default_factory=tuple)
    precision: str = "fp32"          # the mixed-precision policy compiled in (te_passes/precision.py)
    arch: str = ""                   # CPU: the architecture the library was built for (x86_64, aarch64)
    cpu_features: tuple[str, ...] = ()  # CPU: the instruction-set extensions it may use (cpu_features.py)
    member_sha256: tuple[tuple[str, str], ...] = ()  # an exported file's other members and their SHA-256
    target_description: str = ""     # the target in words, as describe() prints it

    def buffer(self, name: str) -> BufferSpec:
        return next(b for b in self.buffers if b.name == name)

    @property
    def device_launches(self) -> int:
        """Device kernel launches per inference (one per call on the CPU)."""
        return sum(sum(l.launches_per_call for l in c.launches) if c.launches else 1 for c in self.calls)

    def random_feeds(self, seed: int = 0) -> dict[str, np.ndarray]:
        """Inputs for tests and benchmarks: standard-normal floats, 0/1 integers and booleans."""
        rng = np.random.default_rng(seed)
        feeds = {}
        for name, buffer in self.inputs:
            spec = self.buffer(buffer)
            value = rng.standard_normal(spec.shape) if spec.dtype.startswith("float") else rng.integers(0, 2, spec.shape)
            feeds[name] = value.astype(spec.dtype)
        return feeds

    def to_json(self) -> str:
        return json.dumps({"version": PLAN_VERSION, **asdict(self)}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "ExecutionPlan":
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"a plan is a JSON object, not {type(data).__name__}")
        version = data.pop("version", None)
        if version != PLAN_VERSION:
            raise PlanVersionError(f"plan version {version!r}: this souffle-py reads version {PLAN_VERSION} "
                                   "(export the model again with this version)")
        return cls(
            target=data["target"], device=data["device"], inputs=tuple((i, b) for i, b in data["inputs"]),
            outputs=tuple((o, b) for o, b in data["outputs"]),
            buffers=tuple(BufferSpec(b["name"], tuple(b["shape"]), b["dtype"], b["role"]) for b in data["buffers"]),
            calls=tuple(KernelCall(**{**c, "args": tuple(c["args"]), "stages": tuple(c["stages"]),
                                      "nodes": tuple(c["nodes"]),
                                      "launches": tuple(Launch(**{**l, "stage_schedules": tuple(
                                          tuple(x) for x in l.get("stage_schedules", ()))}) for l in c["launches"])})
                        for c in data["calls"]),
            distinct=data["distinct"], device_binary=data.get("device_binary", ""),
            notes=tuple(data.get("notes", ())), precision=data.get("precision", "fp32"), arch=data.get("arch", ""),
            cpu_features=tuple(data.get("cpu_features", ())),
            member_sha256=tuple((m, h) for m, h in data.get("member_sha256", ())),
            target_description=data.get("target_description", ""))


def plan_for(program, kernels, function_of, distinct: int, target, device: str, launches=None,
             device_binary: str = "", notes=(), precision: str = "fp32", target_description: str = "") -> ExecutionPlan:
    """The plan of kernels built for `program`: `function_of[i]` is kernel i's symbol in the library,
    `launches` a function's device kernels (GPU targets)."""
    from souffle_py.codegen.kernels import buffer_name, buffer_specs
    from souffle_py.ir.analysis import te_flops

    inputs = tuple((name, buffer_name(t)) for name, t in program.inputs.items())
    outputs = tuple((name, buffer_name(t)) for name, t in program.outputs.items())
    roles = {**{b: "output" for _, b in outputs}, **{b: "input" for _, b in inputs},
             **{name: "param" for name in program.params}}
    buffers = tuple(BufferSpec(name, shape, dtype, roles.get(name, "intermediate"))
                    for name, (shape, dtype) in buffer_specs(program).items())
    flops = {op.name: te_flops(op) for op in program.stages}
    calls = tuple(KernelCall(name=k.name, function=fn, args=k.args, stages=k.stages,
                             nodes=tuple(sorted({program.origins.get(s, "?") for s in k.stages})),
                             reason=k.reason, time_loops=len(k.loops), launches=(launches or {}).get(fn, ()),
                             flops=sum(flops.get(s, 0) for s in k.stages))
                  for k, fn in zip(kernels, function_of))
    arch, features = "", ()
    if device == "cpu":
        from souffle_py.cpu_features import required_features, target_arch

        arch, features = target_arch(target), tuple(required_features(target))
    return ExecutionPlan(target=str(target), device=device,
                         inputs=inputs, outputs=outputs, buffers=buffers, calls=calls, distinct=distinct,
                         device_binary=device_binary, notes=tuple(notes), precision=precision, arch=arch,
                         cpu_features=features, target_description=target_description)
