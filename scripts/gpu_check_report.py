"""gpu_check.py's report: the machine's facts and every table, as DIR/gpu-report.md and DIR/gpu-report.json,
rewritten after every job (so a run cut off at its time limit still leaves what it measured).

Device columns read "no GPU" on a machine without one; jobs the budget left out read "not run".
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import time

from gpu_check_jobs import ABLATION, NO_GPU, SIMULATED

TARGETS = {  # the open GPU targets (issues of the CUDA backend), checked where measured
    "bert": "BERT-base under 2.27 ms (PyTorch's CUDA graph fp32) and 1.5x faster than TVM Relax + dlight",
    "lstm": "LSTM under 3.27 ms (PyTorch's CUDA graph fp32), goal 0.5 ms",
    "every": "every model faster than TVM Relax + dlight",
    "ablation": "V3 at least 2x faster than V0",
}
RELAX = "TVM Relax + dlight"
ABLATION_ROWS = list(ABLATION)


def _run(command) -> str:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def gpu_facts(device: dict) -> dict:
    """The GPU (name, driver, CUDA, clocks where nvidia-smi reads them, SMs, compute mode), nvcc, TVM,
    PyTorch, host; `device` is what TVM sees (gpu_check.probe_device)."""
    gpu = device["present"]
    facts = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "host": platform.node(),
             "cpu": _cpu_name(), "cores": os.cpu_count()}
    nvcc = re.search(r"release ([\d.]+)", _run(["nvcc", "--version"]) or _run(["/usr/local/cuda/bin/nvcc", "--version"]))
    facts["nvcc"] = nvcc.group(1) if nvcc else "not found"
    try:
        import tvm

        facts["tvm"] = tvm.__version__
    except ImportError:
        facts["tvm"] = "missing"
    try:
        import torch

        facts["torch"] = f"{torch.__version__} (CUDA {torch.version.cuda})"
    except ImportError:
        facts["torch"] = "missing"
    if not gpu:
        facts["gpu"] = f"{NO_GPU} (compile only, for sm_90 with the H100's figures)"
        return facts
    if SIMULATED:
        facts.update(gpu="the CPU, simulating the device half (SOUFFLE_GPU_CHECK_SIMULATE=cpu, target llvm)",
                     **{k: "-" for k in ("sms", "compute_capability", "memory", "driver", "cuda", "clocks",
                                         "power_limit")})
        return facts
    fields = ("name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem,clocks.max.mem,power.limit,"
              "compute_mode")
    row = _run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"]).splitlines()
    values = dict(zip(fields.split(","), [v.strip() for v in row[0].split(",")])) if row else {}
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", _run(["nvidia-smi"]))
    facts.update(gpu=values.get("name") or device["name"], driver=values.get("driver_version", "?"),
                 cuda=cuda.group(1) if cuda else "?", sms=device["sms"], compute_mode=values.get("compute_mode", "?"),
                 compute_capability=device["compute_capability"], memory=values.get("memory.total", "?"),
                 clocks=(f"SM {values.get('clocks.sm', '?')} (max {values.get('clocks.max.sm', '?')}), memory "
                         f"{values.get('clocks.mem', '?')} (max {values.get('clocks.max.mem', '?')})"
                         if values else "not readable"),
                 power_limit=values.get("power.limit", "?"))
    return facts


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


# --- tables --------------------------------------------------------------------------------------------------
def _by_kind(results, kind):
    return [r for r in results if r.get("job", {}).get("kind") == kind]


def _size(job) -> str:
    return "tiny" if job.get("tiny") else "paper"


def _status_cell(result) -> str | None:
    """The cell for a job without figures: not run, cut off, or failed with its message."""
    status = result.get("status", "")
    if status.startswith("not run"):
        return "not run (budget)"
    if status == "cut off at the budget":
        return "cut off at the budget"
    if result.get("error"):
        return f"FAILED: {_cell(result['error'])}"
    return None


def _cell(text) -> str:
    return str(text).replace("|", "/").replace("\n", " ")[:160]


def _ms(value) -> str:
    return f"{value:.3f}" if isinstance(value, (int, float)) else ""


def compile_table(results) -> list[str]:
    lines = ["| model | size | variant | kernel calls | device launches | cooperative | grid syncs | registers "
             "(grid kernels) | registers (all) | spills (B) | max shared (B) | compile (s) |",
             "|---|---|---|---:|---:|---:|---:|---|---|---:|---:|---:|"]
    for r in _by_kind(results, "correctness"):
        job, c = r["job"], r.get("steps", {}).get("compile")
        head = f"| {job['model']} | {_size(job)} | {job['variant']} |"
        if not c or "kernel_calls" not in c:
            lines.append(f"{head} {_status_cell(r) or 'no figures'} | | | | | | | | |")
            continue
        compile_s = f"{c['compile_s']}" + (" (cached)" if c.get("cached") else "") if c.get("compile_s") is not None else ""
        lines.append(f"{head} {c['kernel_calls']} | {c['launches']} | {c['cooperative']} | {c['grid_syncs']} | "
                     f"{_span(c['grid_registers'])} | {_span(c['registers'])} | {c['spill_bytes']} | "
                     f"{c['max_shared_bytes']} | {compile_s} |")
    return lines


def _span(values) -> str:
    if not values:
        return ""
    return str(values[0]) if len(values) == 1 else f"{min(values)}-{max(values)}"


def readiness_table(results) -> list[str]:
    lines = ["| model | size | grid-syncing kernels | cooperative tag set | grid fits one wave | "
             "export loads without nvcc | problems |", "|---|---|---:|---:|---:|---|---|"]
    for r in _by_kind(results, "correctness"):
        job, steps = r["job"], r.get("steps", {})
        if job["variant"] != "merged":
            continue
        ready, reload = steps.get("readiness"), steps.get("reload", {})
        if not ready:
            lines.append(f"| {job['model']} | {_size(job)} | {_status_cell(r) or 'no figures'} | | | | |")
            continue
        problems = "; ".join(ready["problems"]) or "none"
        loads = ("yes" if reload.get("ok") else f"NO: {_cell(reload.get('error', reload))}") if reload else ""
        lines.append(f"| {job['model']} | {_size(job)} | {ready['grid_kernels']} | {ready['tagged']} | "
                     f"{ready['fit']} | {loads} | {_cell(problems)} |")
    return lines


def correctness_table(results) -> list[str]:
    cells: dict[tuple, dict] = {}
    for r in _by_kind(results, "correctness"):
        job, steps = r["job"], r.get("steps", {})
        device = steps.get("device", {})
        if device.get("status") == NO_GPU:
            cell = NO_GPU
        elif "matches" in device:
            cell = (f"{'ok' if device['matches'] else 'MISMATCH'} {device['max_abs_diff']:.1e}, "
                    f"{device['median_ms']:.3f} ms")
        else:
            cell = _status_cell(r) or "no result"
        row = cells.setdefault((job["model"], _size(job)), {})
        row[job["variant"]] = cell
        if job["variant"] == "merged":
            reload = steps.get("reload")
            row["reload"] = (NO_GPU if not reload or "identical_to_before_export" not in reload
                             else f"{'ok' if reload['ok'] else 'MISMATCH'} (identical to before export: "
                                  f"{'yes' if reload['identical_to_before_export'] else 'no'})")
    lines = ["| model | size | merged (grid sync) | grid_sync=False | unfused | export, load, re-run |",
             "|---|---|---|---|---|---|"]
    for (model, size), row in cells.items():
        lines.append(f"| {model} | {size} | {row.get('merged', '')} | {row.get('no grid sync', '')} | "
                     f"{row.get('unfused', '')} | {row.get('reload', '')} |")
    return lines


def systems_table(result, reference: str) -> list[str]:
    """One benchmark or ablation job's rows: latency, ratio to `reference`, kernels, syncs, check."""
    steps = {k: v for k, v in result.get("steps", {}).items() if k != "profile"}
    ref = steps.get(reference, {}).get("median_ms")
    lines = [f"| system | latency (ms, median) | vs {reference} | kernels | grid syncs | max abs diff vs ORT | "
             "matches | compile (s) |", "|---|---:|---:|---:|---:|---:|:---:|---:|"]
    for name, step in steps.items():
        if "median_ms" in step and isinstance(step["median_ms"], (int, float)) and step["median_ms"] == step["median_ms"]:
            ratio = f"{step['median_ms'] / ref:.2f}x" if ref else ""
            diff = step.get("max_abs_diff")
            lines.append(f"| {name} | {_ms(step['median_ms'])} | {ratio} | {step.get('kernels') or ''} | "
                         f"{step.get('grid_syncs') or ''} | {'' if diff is None else f'{diff:.1e}'} | "
                         f"{'yes' if step.get('matches') else 'NO'} | {step.get('compile_s', '')} |")
        else:
            what = step.get("error") or step.get("status") or ""
            figures = (f"; {step['kernel_calls']} kernel calls, {step['launches']} device launches, "
                       f"{step['grid_syncs']} grid syncs" if "kernel_calls" in step else "")
            lines.append(f"| {name} | {_cell(what)}{figures} | | | | | | {step.get('compile_s', '')} |")
    if len(lines) == 2:
        lines.append(f"| {_status_cell(result) or 'no result'} | | | | | | | |")
    profile = result.get("steps", {}).get("profile", {}).get("top")
    if profile:
        lines += ["", "profile() of souffle-py, slowest kernel calls (ms within inferences; alone):", "",
                  "| kernel call | TEs | ms | share | alone ms |", "|---|---:|---:|---:|---:|"]
        lines += [f"| {p['kernel']} | {p['tes']} | {p['median_ms']:.3f} | {p['share']:.0%} | {p['alone_ms']:.3f} |"
                  for p in profile]
    return lines


def summary_table(results) -> list[str]:
    lines = ["| model | souffle-py (ms) | TVM Relax + dlight (ms) | vs Relax | Relax, CUDA graph (ms) | best PyTorch "
             "fp32 (ms) | best PyTorch fp16 (ms) | kernels | grid syncs |", "|---|---:|---:|---:|---:|---|---|---:|---:|"]
    for r in _by_kind(results, "bench"):
        steps, model = r.get("steps", {}), r["job"]["model"]
        ours, relax = steps.get("souffle-py", {}), steps.get(RELAX, {})
        if not isinstance(ours.get("median_ms"), (int, float)):
            status = _status_cell(r) or ours.get("status") or ours.get("error") or "no result"
            lines.append(f"| {model} | {status} | | | | | | {ours.get('launches', '')} | {ours.get('grid_syncs', '')} |")
            continue
        ratio = _versus(ours["median_ms"], relax["median_ms"]) if _timed(relax) else ""
        lines.append(f"| {model} | {_ms(ours['median_ms'])} | {_ms(relax.get('median_ms'))} | {ratio} | "
                     f"{_ms(steps.get(RELAX + ', CUDA graph', {}).get('median_ms'))} | {_best(steps, False)} | "
                     f"{_best(steps, True)} | {ours.get('kernels', '')} | {ours.get('grid_syncs', '')} |")
    return lines


def _versus(ours_ms: float, theirs_ms: float) -> str:
    """A speed ratio that reads the right way round: 3.25x slower, not 0.31x faster."""
    if ours_ms <= theirs_ms:
        return f"{theirs_ms / ours_ms:.2f}x faster"
    return f"{ours_ms / theirs_ms:.2f}x slower"


def _timed(step) -> bool:
    return isinstance(step.get("median_ms"), (int, float)) and step["median_ms"] == step["median_ms"]


def _best(steps, fp16: bool) -> str:
    timed = [(s["median_ms"], n) for n, s in steps.items()
             if n.startswith("PyTorch") and n.endswith("fp16") == fp16 and _timed(s)]
    if not timed:
        return ""
    ms, name = min(timed)
    return f"{ms:.3f} ({name.removeprefix('PyTorch ').removesuffix(' fp16')})"


def targets_table(results) -> list[str]:
    bench = {r["job"]["model"]: r.get("steps", {}) for r in _by_kind(results, "bench")}
    ablation = {r["job"]["model"]: r.get("steps", {}) for r in _by_kind(results, "ablation")}

    def ms(steps, name):
        step = steps.get(name, {})
        return step["median_ms"] if _timed(step) else None

    rows = []
    bert = bench.get("bert", {})
    ours, relax = ms(bert, "souffle-py"), ms(bert, RELAX)
    rows.append((TARGETS["bert"], "not measured" if ours is None else
                 f"{ours:.3f} ms, {_versus(ours, relax)} than Relax: " if relax else f"{ours:.3f} ms: ",
                 ours is not None and ours < 2.27 and relax is not None and relax / ours >= 1.5))
    lstm = ms(bench.get("lstm", {}), "souffle-py")
    rows.append((TARGETS["lstm"], "not measured" if lstm is None else f"{lstm:.3f} ms: ",
                 lstm is not None and lstm < 3.27))
    pairs = {m: (ms(s, "souffle-py"), ms(s, RELAX)) for m, s in bench.items()}
    pairs = {m: p for m, p in pairs.items() if None not in p}
    slower = [m for m, (o, r) in pairs.items() if o >= r]
    rows.append((TARGETS["every"], "not measured" if not pairs else
                 f"{len(pairs) - len(slower)} of {len(pairs)} measured faster"
                 + (f" (slower: {', '.join(slower)})" if slower else "") + ": ", bool(pairs) and not slower))
    for model, steps in ablation.items():
        v0, v3 = ms(steps, next(iter(ABLATION_ROWS))), ms(steps, ABLATION_ROWS[3])
        rows.append((f"{TARGETS['ablation']} ({model})", "not measured" if None in (v0, v3) else
                     f"V0 {v0:.3f} ms, V3 {v3:.3f} ms, {v0 / v3:.2f}x: ", None not in (v0, v3) and v0 / v3 >= 2))
    lines = ["| target | measured | met |", "|---|---|:---:|"]
    for target, text, met in rows:
        lines.append(f"| {target} | {text.rstrip(': ')} | {'' if text == 'not measured' else 'yes' if met else 'no'} |")
    return lines


def write_report(out: str, facts: dict, results: list, job_names: list, args, elapsed: float) -> None:
    """DIR/gpu-report.json (everything) and DIR/gpu-report.md (the tables), each written atomically."""
    gpu = not facts["gpu"].startswith(NO_GPU)
    meta = dict(facts, parts=list(args.parts), budget_s=args.budget_s, elapsed_s=round(elapsed, 1),
                jobs_at_a_time=args.jobs, jobs_planned=len(job_names), jobs_finished=len(results),
                command="python scripts/gpu_check.py " + " ".join(_argv(args)))
    _write(os.path.join(out, "gpu-report.json"), json.dumps({"meta": meta, "results": results}, indent=1, default=str))
    md = [f"# souffle-py GPU check ({facts['date']})", "",
          f"`{meta['command']}`: {len(results)} of {len(job_names)} jobs after {elapsed:.0f} s "
          f"({args.jobs} at a time, budget {args.budget_s:.0f} s).", "",
          f"- GPU: {facts['gpu']}" + (f", {facts['sms']} SMs, compute capability {facts['compute_capability']}, "
                                      f"{facts['memory']}" if gpu else ""),
          ]
    if gpu:
        md += [f"- driver {facts['driver']}, CUDA {facts['cuda']}; clocks: {facts['clocks']}; power limit "
               f"{facts['power_limit']}; compute mode {facts.get('compute_mode', '?')}"]
    md += [f"- nvcc {facts['nvcc']}, TVM {facts['tvm']}, PyTorch {facts['torch']}",
           f"- host: {facts['cpu']}, {facts['cores']} cores", ""]
    if "correctness" in args.parts:
        md += ["## CUDA compile", "", "Untuned, default passes, target `cuda` (the present GPU; without one sm_90 "
               "with the H100's figures). Registers per thread, spills and static shared memory from `ptxas -v`.",
               ""] + compile_table(results)
        md += ["", "## Launch readiness (merged kernels, from the exported file)", "",
               "Kernels that call a grid barrier (device source); the cooperative-launch tag TVM serialized with "
               "each (what its runtime reads to launch it cooperatively); whether its grid fits one wave of the "
               "compile target (SMs x resident blocks at ptxas's registers and shared memory; the tests check models "
               "compiled for `h100` and for `a100` the same way); the export loaded in a fresh process with nvcc "
               "disabled (without a GPU: TVM's load-time compile callback returns the exported binary).",
               ""] + readiness_table(results)
        md += ["", "## Correctness on the device (against ONNX Runtime on the host CPU)", "",
               "Each cell: max abs diff (rtol = atol = 1e-4) and the median of 5 runs; each variant in a process "
               "of its own.", ""] + correctness_table(results)
        for r in _by_kind(results, "pytest"):
            step = r.get("steps", {}).get("pytest -m gpu", {})
            md += ["", f"`pytest -m gpu tests`: {step.get('summary') or step.get('status') or _status_cell(r)}"]
            md += [f"- {line}" for line in step.get("failures", [])]
    if "bench" in args.parts:
        md += ["", "## Benchmarks", "", "Batch 1, medians of interleaved rounds (benchmark.measure), outputs against "
               "ONNX Runtime; PyTorch fp16 rows are the modules in float16 (held to 5e-2 abs); souffle-py has no "
               "fp16 path yet. Timed one job at a time while other jobs compile on the host.", ""]
        md += summary_table(results)
        for r in _by_kind(results, "bench"):
            md += ["", f"### {r['job']['model']} ({_size(r['job'])})", ""] + systems_table(r, RELAX)
    if "ablation" in args.parts:
        md += ["", "## Ablation (the paper's Table 4)", ""]
        md += [] if _by_kind(results, "ablation") else ["No ablation model (BERT-base, the LSTM) in this run."]
        for r in _by_kind(results, "ablation"):
            md += [f"### {r['job']['model']} ({_size(r['job'])})", ""] + systems_table(r, ABLATION_ROWS[0]) + [""]
    if "bench" in args.parts or "ablation" in args.parts:
        md += ["", "## Targets", ""] + (targets_table(results) if gpu else [f"{NO_GPU}: none measured."])
    failed = [r for r in results if r.get("status") in ("failed", "cut off at the budget")]
    if failed:
        md += ["", "## Failed or cut-off jobs", ""]
        for r in failed:
            md += [f"- {r['job']['name']}: {r['status']}, {_cell(r.get('error', ''))}", "", "```",
                   (r.get("log_tail") or "")[-1200:].strip(), "```"]
    unrun = [r["job"]["name"] for r in results if r.get("status", "").startswith("not run")]
    if unrun:
        md += ["", f"Not run (budget): {', '.join(unrun)}."]
    _write(os.path.join(out, "gpu-report.md"), "\n".join(md) + "\n")


def _argv(args) -> list[str]:
    argv = ["--out", args.out, "--part", ",".join(args.parts), "--budget-s", f"{args.budget_s:g}"]
    argv += ["--tiny"] if args.tiny else []
    argv += ["--resume"] if args.resume else []
    argv += ["--models", *args.models] if args.models else []
    return argv


def _write(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)
