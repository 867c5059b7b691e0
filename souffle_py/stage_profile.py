"""Where a merged CPU kernel's time goes: each stage's time, measured inside the kernel.

A merged kernel runs its stages one loop nest after another (the root block's statements, merge.py). The
profile builds a second, instrumented copy of each scheduled kernel function: one extra int64 parameter,
the clock buffer, and before the first nest and after every nest a store of the CPU's cycle counter
(`llvm.readcyclecounter`, rdtsc on x86: a few cycles, no call, no Python) into it. The copy is compiled
apart from the model's library, so the normal build never carries the stores. Running whole inferences
with every call replaced by its instrumented copy gives each nest's cycles in context (its inputs as warm
or cold as in a real inference); the counter's rate is calibrated against the wall clock once per process.

Each nest is one stage group: usually one stage (TE), sometimes several (a conv with its epilogue computed
at its tiles, a recurrence's time loop). Each group names its TEs, their ONNX nodes, the schedule rule
their block got (schedule/blocks.py `block_kind`: gemm, conv, reduction, pad, injective) and its
operations (te_flops), so its rate can be rated against the measured FMA peak (backends/cpu_peak.py).
"""

from __future__ import annotations

import re
import statistics
import time
from functools import lru_cache

import numpy as np
import tvm
import tvm_ffi
from tvm import s_tir, tirx

from souffle_py.errors import SouffleError

CLOCK = "stage_clock"
_STAGE_BLOCK = re.compile(r"^s(\d+)(?:_|$)")  # merge.py names stage i's block "s{i}"; derived blocks "s{i}_..."


class StageProfileError(SouffleError):
    """The model cannot be profiled stage by stage (not a CPU model compiled in this process)."""


def instrumented(func: tirx.PrimFunc, name: str) -> tuple[tirx.PrimFunc, list[list[int]]]:
    """`func` (scheduled) with a clock parameter appended and a cycle-counter store before its first loop
    nest and after each one; also, per nest, the stage indices whose blocks it holds (in order)."""
    realize = func.body
    if not isinstance(realize, s_tir.stmt.SBlockRealize):
        raise StageProfileError(f"kernel function '{name}' has no root block to instrument")
    root = realize.block
    nests = list(root.body.seq) if isinstance(root.body, tirx.SeqStmt) else [root.body]
    clock = tirx.decl_buffer((len(nests) + 1,), "int64", name=CLOCK)

    def stamp(i):
        return tirx.BufferStore(clock, tirx.call_llvm_intrin("int64", "llvm.readcyclecounter"), [i])

    body = [stamp(0)]
    for i, nest in enumerate(nests):
        body += [nest, stamp(i + 1)]
    new_root = s_tir.stmt.SBlock(root.iter_vars, root.reads, root.writes, root.name_hint, tirx.SeqStmt(body),
                                 root.init, root.alloc_buffers, root.match_buffers, root.annotations)
    new_func = tirx.PrimFunc([*func.params, clock], s_tir.stmt.SBlockRealize(realize.iter_values, realize.predicate,
                                                                            new_root), func.ret_type, func.attrs)
    return new_func.with_attr("global_symbol", name), _stages_of(nests)


def _stages_of(nests) -> list[list[int]]:
    """Per nest, the stage indices of its blocks, and of the stages with no block of their own that one of
    its blocks writes (a GEMM's write-back block "s14_local" storing stage 15's GELU epilogue into buffer
    s15: that work runs, and is timed, in the GEMM's nest, not in its consumer's)."""
    named, written = zip(*(_stages_in(nest) for nest in nests)) if nests else ((), ())
    owned = {j for stages in named for j in stages}
    result, placed = [], set()
    for stages, writes in zip(named, written):
        extra = [j for j in writes if j not in owned and j not in placed]
        placed.update(extra)
        result.append(sorted({*stages, *extra}))
    return result


def _stages_in(nest) -> tuple[list[int], list[int]]:
    """The stage indices named by `nest`'s blocks, and those named by the buffers they write."""
    named: set[int] = set()
    written: set[int] = set()

    def note(name, into):
        match = _STAGE_BLOCK.match(str(name))
        if match:
            into.add(int(match.group(1)))

    def visit(block):
        note(block.name_hint, named)
        for region in block.writes:
            note(region.source.name, written)

    tvm_ffi.structural_walk(nest, [(s_tir.stmt.SBlock, visit)])
    return sorted(named), sorted(written)


@lru_cache(maxsize=None)
def cycles_per_second() -> float:
    """The cycle counter's rate, against perf_counter over 0.2 s (x86's invariant TSC: constant)."""
    clock = tirx.decl_buffer((1,), "int64", name=CLOCK)
    read = tirx.BufferStore(clock, tirx.call_llvm_intrin("int64", "llvm.readcyclecounter"), [0])
    func = tirx.PrimFunc([clock], read).with_attr("global_symbol", "souffle_clock_now")
    now = tvm.compile(tvm.IRModule({"souffle_clock_now": func}), target="llvm")["souffle_clock_now"]
    value = tvm.runtime.tensor(np.zeros(1, "int64"))
    now(value)
    c0, t0 = int(value.numpy()[0]), time.perf_counter()
    time.sleep(0.2)
    now(value)
    c1, t1 = int(value.numpy()[0]), time.perf_counter()
    return (c1 - c0) / (t1 - t0)


def _stage_facts(model) -> tuple[dict, dict]:
    """Operations by TE name and the rule each kernel's stage blocks get, by (kernel index, stage index)."""
    from souffle_py.schedule.blocks import block_kind
    from souffle_py.ir.analysis import te_flops

    flops = {op.name: te_flops(op) for op in model.program.stages}
    rules = {}
    for k, kernel in enumerate(model.kernels):
        sch = s_tir.Schedule(kernel.func)
        for j in range(len(kernel.stages)):
            try:
                rules[k, j] = block_kind(sch, sch.get_sblock(f"s{j}"))
            except Exception:  # a kernel that is not a merged one (no block of that name)
                rules[k, j] = "?"
    return flops, rules


def profile_stages(model, feeds, repeat: int = 10) -> list[tuple[list[dict], float, float]]:
    """Per kernel call (plan order), its stage groups, the instrumented call's median ms and the normal
    call's median ms in inferences alternating with those. A group has `stages` (TE names), `nodes` (ONNX nodes), `rule`, `median_ms` (within `repeat`
    whole inferences, every call instrumented), `flops`, `gflop_s`."""
    if model.plan.device != "cpu":
        raise StageProfileError("the stage profile times the stages of CPU kernels; this model is compiled "
                                f"for {model.plan.device} (profile() without stages=True gives its kernels)")
    if not model.kernels or not model.scheduled_functions or model.program is None:
        raise StageProfileError("the stage profile needs the model as compiled in this process (its scheduled "
                                "kernel functions); a model loaded from a file has only its library")
    names = {}
    functions, nests_of = {}, {}
    for call in model.plan.calls:
        if call.function not in names:
            names[call.function] = f"{call.function}__stages"
            functions[names[call.function]], nests_of[call.function] = instrumented(
                model.scheduled_functions[call.function], names[call.function])
    try:
        library = tvm.compile(tvm.IRModule(functions), target=model.target, tir_pipeline=_pipeline())
    except Exception as exc:
        raise StageProfileError(f"TVM could not compile the instrumented kernels: {exc}") from exc
    rate = cycles_per_second()
    model._check(feeds)
    with model.workspace() as ws:
        model._load(ws, feeds)
        samples, walls, plain = _timed_runs(model, ws.calls, library, names, nests_of, rate, repeat)
    flops, rules = _stage_facts(model)
    origins = model.program.origins
    consumers = {op.name: [c.name for c in users] for op, users in model.program.consumers().items()}
    result = []
    for k, (call, per_nest, wall, own) in enumerate(zip(model.plan.calls, samples, walls, plain)):
        nests = _with_inlined(nests_of[call.function], call.stages, consumers)
        groups = []
        for (stage_indices, inlined), times in zip(nests, per_nest):
            tes = [call.stages[j] for j in stage_indices if j < len(call.stages)]
            ms = statistics.median(times)
            ops = sum(flops.get(te, 0) for te in tes)
            groups.append({"stages": tes, "inlined": [call.stages[j] for j in inlined],
                           "nodes": sorted({origins.get(te, "?") for te in tes}),
                           "rule": "+".join(dict.fromkeys(rules.get((k, j), "?") for j in stage_indices)) or "?",
                           "median_ms": ms, "flops": ops, "gflop_s": ops / ms / 1e6 if ms > 0 else 0.0})
        result.append((groups, statistics.median(wall[1:]), statistics.median(own[1:])))
    return result


def _timed_runs(model, own_calls, library, names, nests_of, rate, repeat):
    """Per call: each nest's ms in the instrumented inferences, the instrumented call's ms and the call's
    own ms, in alternating inferences (after one warm-up)."""
    device = model.device
    clocks = [tvm.runtime.empty((len(nests_of[c.function]) + 1,), "int64", device) for c in model.plan.calls]
    calls = [(library[names[c.function]], [*args, clock])
             for c, (_, args), clock in zip(model.plan.calls, own_calls, clocks)]
    samples = [[[] for _ in nests_of[c.function]] for c in model.plan.calls]
    walls: list[list[float]] = [[] for _ in calls]
    plain: list[list[float]] = [[] for _ in calls]
    for run in range(repeat + 1):  # the first run warms up
        # an inference of the normal kernels, then one of the instrumented copies: the stages' sum compares
        # with the kernel's own time under the same conditions (a shared machine drifts)
        for timed, (func, args) in [*zip(plain, own_calls), *zip(walls, calls)]:
            start = time.perf_counter()
            func(*args)
            timed.append((time.perf_counter() - start) * 1e3)  # CPU kernels return when done
        if run:
            for per_nest, clock in zip(samples, clocks):
                stamps = clock.numpy()
                for j, cycles in enumerate(np.diff(stamps)):
                    per_nest[j].append(cycles / rate * 1e3)
    return samples, walls, plain


def _with_inlined(nests: list[list[int]], stages, consumers) -> list[tuple[list[int], list[int]]]:
    """Each nest's stage indices completed by the stages a schedule inlined (an activation computed inside
    the next conv's padding): each goes to the nest of its nearest consumer that has a block of its own."""
    nest_of = {j: i for i, nest in enumerate(nests) for j in nest}
    index_of = {name: j for j, name in enumerate(stages)}
    inlined: list[list[int]] = [[] for _ in nests]
    for j, name in enumerate(stages):
        if j in nest_of:
            continue
        frontier, seen = list(consumers.get(name, ())), set()
        while frontier:
            user = frontier.pop(0)
            if user in seen or user not in index_of:
                continue
            seen.add(user)
            if index_of[user] in nest_of:
                inlined[nest_of[index_of[user]]].append(j)
                break
            frontier += consumers.get(user, ())
    return [(sorted(nest + extra), extra) for nest, extra in zip(nests, inlined)]


def _pipeline():
    from souffle_py.codegen.stack_locals import PIPELINE
    return PIPELINE


def stage_lines(row: dict, peak_gflops: float | None = None, top: int | None = None, indent: str = "    ") -> list[str]:
    """A kernel row's stage groups, slowest first, as table lines (time, share of the kernel, rule, rate,
    share of the peak, TEs and ONNX nodes)."""
    groups = sorted(row.get("stages", ()), key=lambda g: -g["median_ms"])
    total = sum(g["median_ms"] for g in groups) or 1.0
    lines = []
    for g in groups[:top]:
        rate = f"{g['gflop_s']:7.1f} GFLOP/s" if g["flops"] else f"{'':>15}"
        if g["flops"] and peak_gflops:
            rate += f" {g['gflop_s'] / peak_gflops:4.0%} peak"
        elif peak_gflops:
            rate += " " * 10
        lines.append(f"{indent}{g['median_ms']:9.4f} ms {g['median_ms'] / total:6.1%}  {g['rule']:<10} {rate}  "
                     f"{', '.join(g['stages'])[:60]}  <- {', '.join(g['nodes'])[:80]}")
    if groups:
        stages_ms = sum(g["median_ms"] for g in groups)
        lines.append(f"{indent}{len(groups)} stage groups, sum {stages_ms:.4f} ms: {stages_ms / row['paired_ms']:.0%} "
                     f"of the kernel's {row['paired_ms']:.4f} ms (in inferences alternating with the instrumented "
                     f"ones, which took {row['instrumented_ms']:.4f} ms)")
    return lines
