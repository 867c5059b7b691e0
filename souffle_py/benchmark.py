"""Side-by-side measurement of compiled models: one run, same inputs, medians, ratios to ONNX Runtime.

Scripts (compile_*.py, bench.py) and `make demo` print these tables; absolute times drift on shared
machines, so every row also carries its ratio to ONNX Runtime measured in the same run.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Collection, Mapping

import numpy as np
import onnx

from souffle_py.baselines import OnnxRuntimeModel
from souffle_py.errors import SouffleError
from souffle_py.plan import operations_text
from te_passes.precision import BF16_TOLERANCE

ORT = "ONNX Runtime"
BUSY_CORES_WARNING = 0.25  # cores kept busy by other processes above which the timings are flagged


@dataclass(frozen=True)
class Row:
    system: str
    median_ms: float
    kernels: int | None
    max_abs_diff: float | None   # against ONNX Runtime's outputs
    compile_s: float | None
    matches: bool | None
    error: str | None = None     # why the system could not compile the model (the row has no figures)
    grid_syncs: int | None = None  # grid-wide barriers per inference (souffle-py on a GPU)
    flops: int | None = None       # operations per inference, from the TEs (souffle-py's models)
    single_threaded: bool = False  # its kernels run on one thread (a CPU model of little work)
    max_rel_diff: float | None = None  # max abs diff / the largest |output| of ONNX Runtime
    precision: str = "fp32"        # souffle-py's mixed-precision policy (plan.precision); OpenVINO's hint

    def ratio(self, reference_ms: float) -> float:
        """Latency relative to the reference (ONNX Runtime): > 1 means slower."""
        return self.median_ms / reference_ms


def measure(proto: onnx.ModelProto, systems: Mapping[str, Callable[[onnx.ModelProto], object]],
            repeat: int = 10, warmup: int = 2, threads: int | None = None, rtol: float = 1e-4,
            atol: float = 1e-4, log: Callable[[str], None] = print, block: int = 5,
            reduced: Collection[str] = ()) -> list[Row]:
    """Compile `proto` with each system, check it against ONNX Runtime on the same inputs, time all of them.

    The first row is ONNX Runtime itself; `atol` applies to O(1) outputs (relative 1e-4 in float32). The
    systems take turns, one block of `block` timed runs each per round until each has `repeat`, so that a
    slow phase of this shared machine slows every system alike and the ratios stay comparable. Each block
    starts after a pause and `warmup` untimed runs (at least SETTLE_MS of them): right after a switch the
    other system's thread pool still spins on the cores (ONNX Runtime's and TVM's both busy-wait for a
    while after a run), which slows the first runs several-fold. Systems named in `reduced` compute in a
    reduced precision (bf16): their outputs match when the max abs diff is within te_passes/precision.py's
    BF16_TOLERANCE of the largest output.
    """
    reference = OnnxRuntimeModel(proto, threads=threads)
    feeds = None
    rows = []
    compiled, compile_s, failed = {}, {}, []
    for name, factory in systems.items():
        log(f"  compiling with {name} ...")
        start = time.perf_counter()
        try:
            compiled[name] = factory(proto)
        except SouffleError as exc:  # e.g. TVM Relax's importer has no LSTM: report it, measure the rest
            failed.append(Row(name, float("nan"), None, None, None, None, error=str(exc).splitlines()[0][:120]))
            continue
        compile_s[name] = time.perf_counter() - start
        if feeds is None and hasattr(compiled[name], "plan"):  # OpenVINO rows take souffle-py's feeds
            feeds = compiled[name].random_feeds(seed=0)
    feeds = feeds or reference_feeds(proto)
    expected = reference.run(feeds)
    busy = busy_cores()
    if busy is not None and busy > BUSY_CORES_WARNING:
        log(f"  warning: other processes kept {busy:.1f} of {os.cpu_count()} cores busy just before timing; "
            f"a preempted thread stalls every parallel loop (TVM shares them out statically), so these "
            f"timings are unreliable: measure on idle cores")
    medians = _interleaved_medians({ORT: reference, **compiled}, feeds, repeat, warmup, block)
    rows.append(Row(ORT, medians[ORT], None, 0.0, None, True))
    for name, model in compiled.items():
        outputs = model.run(feeds)
        diff = max(float(np.max(np.abs(outputs[k].astype(np.float64) - v))) if v.size else 0.0
                   for k, v in expected.items())
        scale = max(float(np.max(np.abs(v))) if v.size else 0.0 for v in expected.values())
        if name in reduced:
            ok = diff <= BF16_TOLERANCE * scale
        else:
            ok = all(np.allclose(outputs[k], v, rtol=rtol, atol=atol) for k, v in expected.items())
        plan = getattr(model, "plan", None)
        rows.append(Row(name, medians[name], model.num_kernels, diff, compile_s[name], ok,
                        grid_syncs=getattr(model, "grid_syncs", None),
                        flops=sum(call.flops for call in plan.calls) if plan is not None else None,
                        single_threaded=bool(getattr(model, "single_threaded", False)),
                        max_rel_diff=diff / scale if scale else None,
                        precision=plan.precision if plan is not None else getattr(model, "precision", "fp32")))
    return rows + failed


def reference_feeds(proto: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    """Standard-normal inputs of the model's declared shapes (for a run without souffle-py rows)."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for value in proto.graph.input:
        kind = value.type.tensor_type
        shape = [d.dim_value for d in kind.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(kind.elem_type)
        feeds[value.name] = (rng.standard_normal(shape) if np.issubdtype(dtype, np.floating)
                             else rng.integers(0, 2, shape)).astype(dtype)
    return feeds


def busy_cores(seconds: float = 0.3) -> float | None:
    """Cores that other processes kept busy over `seconds` while this one sleeps (from /proc/stat; None
    where there is none)."""
    def sample():
        with open("/proc/stat") as stat:
            fields = [int(x) for x in stat.readline().split()[1:]]
        return sum(fields), fields[3] + (fields[4] if len(fields) > 4 else 0)  # total, idle + iowait
    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    elapsed = total1 - total0
    return (1.0 - (idle1 - idle0) / elapsed) * (os.cpu_count() or 1) if elapsed > 0 else None


PAUSE_MS = 50.0   # before each block, a pause in which the previous system's spinning threads go to sleep
SETTLE_MS = 20.0  # then untimed runs of the next system, at least this long (_interleaved_medians)


def _interleaved_medians(models: Mapping[str, object], feeds, repeat: int, warmup: int,
                         block: int) -> dict[str, float]:
    """Median latency (ms) per model over `repeat` timed runs, taken in rounds of one block per model.
    Each block follows a pause of PAUSE_MS and at least `warmup` untimed runs lasting at least SETTLE_MS:
    the previous system's threads spin for a while after its last run (ONNX Runtime's and TVM's pools
    both do), and the two warm-up runs of a 0.45 ms model fell inside that spin, so either system timed
    about 0.87 ms, at random, where both take 0.41-0.46 alone; with the pause, 0.41-0.47 in every run."""
    times: dict[str, list[float]] = {name: [] for name in models}
    while any(len(values) < repeat for values in times.values()):
        for name, model in models.items():
            runs = min(block, repeat - len(times[name]))
            _settle(model, feeds, warmup)
            times[name] += model.benchmark(feeds, repeat=runs, warmup=0)["times_ms"]
    return {name: statistics.median(values) for name, values in times.items()}


def _settle(model, feeds, warmup: int) -> None:
    """Untimed runs of `model`: at least `warmup`, for at least SETTLE_MS."""
    time.sleep(PAUSE_MS / 1e3)
    start, runs = time.perf_counter(), 0
    while runs < warmup or (time.perf_counter() - start) * 1e3 < SETTLE_MS:
        model.benchmark(feeds, repeat=1, warmup=0)
        runs += 1


def format_table(title: str, rows: list[Row], reference_system: str | None = None) -> str:
    """A markdown table: latency, ratio to the reference (ONNX Runtime unless `reference_system` names
    another row: on a GPU, TVM Relax + dlight), kernels per inference, max abs diff vs ONNX Runtime,
    compile time."""
    reference_system = reference_system or ORT
    reference = next(r.median_ms for r in rows if r.system == reference_system)
    syncs = any(r.grid_syncs for r in rows)
    lines = [f"### {title}", "",
             f"| system | latency (ms, median) | vs {reference_system} | kernels | "
             + ("grid syncs | " if syncs else "") + "max abs diff vs ORT | max rel diff | matches | compile (s) |",
             "|---|---:|---:|---:|" + ("---:|" if syncs else "") + "---:|---:|:---:|---:|"]
    for r in rows:
        if r.error:
            lines.append(f"| {r.system} | failed: {r.error} | | | | | | |" + (" |" if syncs else ""))
            continue
        lines.append(f"| {r.system} | {r.median_ms:.3f} | {r.ratio(reference):.2f}x | "
                     f"{'' if r.kernels is None else r.kernels} | "
                     + (f"{r.grid_syncs or ''} | " if syncs else "") +
                     f"{'' if r.max_abs_diff is None or r.system == ORT else f'{r.max_abs_diff:.2e}'} | "
                     f"{'' if r.max_rel_diff is None or r.system == ORT else f'{r.max_rel_diff:.2e}'} | "
                     f"{'' if r.system == ORT else ('yes' if r.matches else 'NO')} | "
                     f"{'' if r.compile_s is None else f'{r.compile_s:.1f}'} |")
    return "\n".join(lines)


def compute_floor(rows: list[Row], peak_gflops: Callable[[bool], float | None]) -> str:
    """Each souffle-py row against the target's measured peak (`peak_gflops(single_threaded)`, the
    backend's): its GFLOP/s, and the compute floor (its inference's operations at that peak) as a ratio to
    ONNX Runtime, the most any schedule could still gain. Empty without a peak or a row with operations."""
    counted = [r for r in rows if r.flops and not r.error and r.median_ms > 0 and r.precision == "fp32"]
    peaks = {single: peak_gflops(single) for single in sorted({r.single_threaded for r in counted})}
    counted = [r for r in counted if peaks[r.single_threaded]]
    reduced = [r for r in rows if r.flops and not r.error and r.median_ms > 0 and r.precision == "bf16"]
    if not counted:
        return ""
    reference = next(r.median_ms for r in rows if r.system == ORT)
    lines = ["Measured float32 peak of these cores: " + ", ".join(
        f"{peak:.1f} GFLOP/s" + (" on the one thread a model of little work runs on" if single else "")
        for single, peak in peaks.items() if peak) + "."]
    for r in counted:
        peak = peaks[r.single_threaded]
        floor_ms = r.flops / peak / 1e6
        lines.append(f"- {r.system}: {operations_text(r.flops)} per inference at {r.flops / r.median_ms / 1e6:.1f} "
                     f"GFLOP/s ({r.flops / r.median_ms / 1e6 / peak:.0%} of the "
                     f"{'one-thread ' if r.single_threaded else ''}peak); at that peak "
                     f"{floor_ms:.3g} ms, {floor_ms / reference:.2f}x {ORT}")
    for r in reduced:  # rated against the bf16 dot-product peak (cpu_peak.py's vdpbf16ps chains)
        peak = peak_gflops(r.single_threaded, "bf16")
        if peak:
            lines.append(f"- {r.system}: {operations_text(r.flops)} per inference at {r.flops / r.median_ms / 1e6:.1f} "
                         f"GFLOP/s, {r.flops / r.median_ms / 1e6 / peak:.0%} of the measured bf16 dot-product "
                         f"peak ({peak:.1f} GFLOP/s)")
    return "\n".join(lines)
