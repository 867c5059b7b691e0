"""The GPU verification run: every GPU figure of souffle-py in one script, each part sized for one
10-minute call on a GPU machine (docs/gpu.md gives the calls).

    python3 scripts/gpu_check.py --out $OUT --part correctness --budget-s $((570 - SECONDS))
    python3 scripts/gpu_check.py --out $OUT --part bench,ablation --budget-s $((570 - SECONDS))
    python scripts/gpu_check.py --out gpu-out --part all       # without a GPU: compile only, ~9 min, exit 2
    python scripts/gpu_check.py --out gpu-out --part all --tiny --models lstm     # a minute

Parts:
  correctness  every model at tiny and paper size, merged (grid-synchronized), grid_sync=False and
               unfused, on the device against ONNX Runtime on the host CPU; the merged model exported,
               loaded in a fresh process with nvcc disabled and run again; `pytest -m gpu` (the modules
               that have GPU tests)
  bench        the paper models and sbert against TVM Relax + dlight (with and without CUDA graphs) and
               PyTorch (eager, CUDA graph, torch.compile; fp32, and fp16 for float inputs): medians,
               ratios, kernels and grid syncs per inference, profile()'s top kernels
  ablation     V0-V3 and V3's stages launched separately, on BERT-base and the LSTM

Each job (a model, size and variant; a model's benchmark) runs in a fresh process, so a launch error, a
mismatch or a poisoned CUDA context is recorded with its message and the run goes on. Jobs compile in
parallel (--jobs) and take the GPU one at a time (a file lock). DIR/gpu-report.md and DIR/gpu-report.json
are rewritten after every job; --budget-s stops starting jobs, and ends running ones, before the budget.

Without a GPU the same run does what needs none (every model compiled for cuda with nvcc, registers,
spills, shared memory, grid syncs, cooperative-launch and occupancy checks, export and load without nvcc),
writes the same report with the device columns marked "no GPU", and exits 2. Exit status otherwise: 0
all ran and matched, 1 a failure or mismatch of souffle-py (a baseline that fails is a row of the report),
3 jobs left unrun or cut off by the budget. SOUFFLE_GPU_CHECK_SIMULATE=cpu runs the device half on the
CPU (target llvm, PyTorch eager on the CPU): the test of this machinery without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_check_jobs import MODELS, NO_GPU, ROOT, VARIANTS  # noqa: E402
from gpu_check_report import gpu_facts, write_report  # noqa: E402

PARTS = ("correctness", "bench", "ablation")
CORRECTNESS_MODELS = ("bert", "lstm", "resnext", "efficientnet", "swin", "mmoe", "sbert")
BENCH_MODELS = ("bert", "lstm", "lstm-unrolled", "efficientnet", "resnext", "swin", "mmoe", "sbert")
ABLATION_MODELS = ("bert", "lstm")
MARGIN_S = 10          # the run ends this long before its budget (the report is written last)
BASELINES = ("TVM Relax", "PyTorch", "ONNX Runtime")  # their failures are rows of the report, not ours
MIN_START_S = 15       # no job starts with less left than this
JOB_LIMIT_S = {"correctness": 300, "bench": 480, "ablation": 420, "pytest": 360}  # a hung kernel ends here
PAPER_CORRECTNESS_LIMIT_S = 480  # Swin-B's paper-size compile alone took 289 s beside three others (H200, 2026-11-27)


def job_limit_s(job: dict) -> int:
    """How long a job may run before it counts as hung: a paper-size compile needs longer than a tiny one."""
    if job["kind"] == "correctness" and not job.get("tiny", True):
        return PAPER_CORRECTNESS_LIMIT_S
    return JOB_LIMIT_S[job["kind"]]


def jobs_for(parts, models, tiny_only: bool, gpu: bool) -> list[dict]:
    """The jobs in the order they start: the GPU tests first (the longest job), every model merged (tiny,
    then paper size: the figures that matter most), the benchmarks of BERT-base and the LSTM, the
    ablation, the other benchmarks, then the other correctness variants (grid_sync=False, unfused)."""
    def chosen(names):
        return [m for m in names if models is None or m in models]

    sizes = (True,) if tiny_only else (True, False)

    def correctness(variants):
        return [{"kind": "correctness", "part": "correctness", "model": model, "tiny": tiny, "variant": variant}
                for variant in variants for tiny in sizes for model in chosen(CORRECTNESS_MODELS)]

    jobs = []
    if "correctness" in parts:
        if gpu and models is None:
            jobs.append({"kind": "pytest", "part": "correctness", "name": "pytest -m gpu"})
        jobs += correctness(["merged"])
    bench = [{"kind": "bench", "part": "bench", "model": m, "tiny": tiny_only}
             for m in chosen(BENCH_MODELS)] if "bench" in parts else []
    ablation = [{"kind": "ablation", "part": "ablation", "model": m, "tiny": tiny_only}
                for m in chosen(ABLATION_MODELS)] if "ablation" in parts else []
    jobs += bench[:2] + ablation + bench[2:]  # the targets first: BERT-base, the LSTM, V3 against V0
    if "correctness" in parts:
        jobs += correctness([v for v in VARIANTS if v != "merged"])
    for job in jobs:
        if "name" not in job:
            job["name"] = (f"{job['kind']} {job['model']} {'tiny' if job['tiny'] else 'paper'}"
                           + (f" {job['variant']}" if "variant" in job else ""))
    return jobs


class Runner:
    """Runs jobs as subprocesses, `parallel` at a time, within a budget; rewrites the report after each."""

    def __init__(self, args, jobs, facts):
        self.args, self.jobs, self.facts = args, jobs, facts
        self.start = time.monotonic()
        self.deadline = self.start + args.budget_s - MARGIN_S
        self.results: list[dict] = []
        self.started = 0
        self.log_file = open(os.path.join(args.out, "gpu-check.log"), "a")
        os.makedirs(os.path.join(args.work, "jobs"), exist_ok=True)
        os.makedirs(os.path.join(args.work, "done"), exist_ok=True)

    def run(self) -> None:
        pending, running = list(self.jobs), []
        if self.args.resume:  # jobs done by an earlier run with this work folder keep their results
            for job in list(pending):
                earlier = self.saved(job)
                if earlier is not None:
                    pending.remove(job)
                    self.results.append(dict(earlier, resumed=True))
                    self.say(f"[{self.elapsed():6.0f}s] done earlier: {job['name']}")
        self.report()
        while pending or running:
            while pending and len(running) < self.args.jobs:
                if self.deadline - time.monotonic() < MIN_START_S:
                    for job in pending:
                        self.results.append({"job": job, "status": "not run: budget"})
                    pending = []
                    break
                running.append(self.launch(pending.pop(0)))
            for entry in list(running):
                now = time.monotonic()
                if (entry["process"].poll() is not None or now > self.deadline
                        or now - entry["started"] > job_limit_s(entry["job"])):
                    running.remove(entry)
                    self.finish(entry)
                    self.report()
            time.sleep(0.2)
        self.report()

    def launch(self, job: dict) -> dict:
        self.started += 1
        stem = os.path.join(self.args.work, "jobs", f"{self.started:03d}-{job['name'].replace(' ', '_')}")
        job = dict(job, work=self.args.work, repeat=self.args.repeat,
                   timeout=max(30, int(self.deadline - time.monotonic())))
        with open(stem + ".job.json", "w") as f:
            json.dump(job, f)
        log = open(stem + ".log", "w")
        self.say(f"[{self.elapsed():6.0f}s] start {job['name']}")
        process = subprocess.Popen([sys.executable, os.path.join(ROOT, "scripts", "gpu_check_jobs.py"),
                                    stem + ".job.json", stem + ".result.json"], stdout=log,
                                   stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        return {"job": job, "process": process, "stem": stem, "log": log, "started": time.monotonic()}

    def finish(self, entry: dict) -> None:
        process, stem = entry["process"], entry["stem"]
        cut = process.poll() is None
        if cut:  # past the budget or its limit: end the job's process group (started in a session of its own)
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        over_limit = cut and time.monotonic() <= self.deadline
        entry["log"].close()
        try:
            with open(stem + ".result.json") as f:
                result = json.load(f)
        except (OSError, ValueError):
            result = {"job": entry["job"], "steps": {}}
        result["job"] = entry["job"]
        result["seconds"] = round(time.monotonic() - entry["started"], 1)
        result["returncode"] = process.returncode
        result["status"] = ("failed" if over_limit else "cut off at the budget" if cut
                            else "failed" if process.returncode else "done")
        if over_limit:
            result["error"] = (f"ended after {job_limit_s(entry['job'])} s, its limit (a kernel that never "
                               "returns, such as a grid barrier some blocks never reach, would look like this)")
        if process.returncode and not cut and "error" not in result:
            result["error"] = f"the job's process ended with status {process.returncode} (see its log)"
        with open(stem + ".log", errors="replace") as f:
            result["log_tail"] = f.read()[-2000:] if result["status"] != "done" else ""
        self.results.append(result)
        if result["status"] == "done":
            with open(self._saved_path(entry["job"]), "w") as f:
                json.dump(result, f, default=str)
        self.say(f"[{self.elapsed():6.0f}s] {result['status']}: {entry['job']['name']} ({result['seconds']} s)"
                 + (f" -- {result.get('error', '')}" if result["status"] != "done" else ""))

    def say(self, line: str) -> None:
        print(line, flush=True)
        self.log_file.write(line + "\n")
        self.log_file.flush()

    def _saved_path(self, job) -> str:
        return os.path.join(self.args.work, "done", job["name"].replace(" ", "_") + ".json")

    def saved(self, job) -> dict | None:
        try:
            with open(self._saved_path(job)) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def report(self) -> None:
        write_report(self.args.out, self.facts, self.results, [j["name"] for j in self.jobs], self.args,
                     self.elapsed())


def exit_status(results, gpu: bool) -> int:
    if not gpu:
        return 2
    if any(r.get("status") != "done" and r.get("status") != "cut off at the budget"
           and not r.get("status", "").startswith("not run") for r in results):
        return 1
    if any(step.get("matches") is False or step.get("ok") is False or step.get("error")
           or (step.get("returncode") not in (None, 0))
           for r in results for name, step in r.get("steps", {}).items() if not name.startswith(BASELINES)):
        return 1
    if any(r.get("status") != "done" for r in results):
        return 3
    return 0


def probe_device() -> dict:
    """The GPU as TVM sees it, from a short process of its own (this one keeps no CUDA context)."""
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_check_jobs.py"), "--probe"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        why = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"gpu_check: cannot import souffle_py and TVM here ({why}); on a GPU machine without "
                         "TVM, source .gpu/b/stage_b.sh first")
    return json.loads(lines[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for gpu-report.md, gpu-report.json, gpu-check.log")
    parser.add_argument("--part", default="all", help="correctness, bench, ablation, all, or a comma list")
    parser.add_argument("--budget-s", type=float, default=570, help="stop cleanly this many seconds after the "
                        "start (default 570: inside one 10-minute call)")
    parser.add_argument("--tiny", action="store_true", help="tiny configurations only (a quick check)")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), help="only these models")
    parser.add_argument("--jobs", type=int, default=None, help="jobs at a time (default: a quarter of the "
                        "cores, at most 4; they compile in parallel and take the GPU one at a time)")
    parser.add_argument("--repeat", type=int, default=20, help="timed runs per system in bench and ablation")
    parser.add_argument("--resume", action="store_true", help="keep the results of jobs an earlier run with "
                        "this --work folder finished (a call cut off at its limit goes on where it stopped)")
    parser.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "souffle-gpu-work"),
                        help="compiled models (a cache across parts and calls), job logs")
    args = parser.parse_args(argv)
    parts = PARTS if args.part == "all" else tuple(p.strip() for p in args.part.split(","))
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"unknown part(s) {', '.join(unknown)}; expected {', '.join(PARTS)} or all")
    args.parts = parts
    args.jobs = args.jobs or max(1, min(4, (os.cpu_count() or 1) // 4))
    args.work = os.path.abspath(args.work)
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.work, exist_ok=True)
    device = probe_device()
    gpu = device["present"]
    facts = gpu_facts(device)
    print(f"gpu_check: {facts['gpu']}; parts {', '.join(parts)}; budget {args.budget_s:.0f} s; "
          f"{args.jobs} job(s) at a time; report in {args.out}", flush=True)
    jobs = jobs_for(parts, args.models, args.tiny, gpu)
    runner = Runner(args, jobs, facts)
    runner.run()
    status = exit_status(runner.results, gpu)
    print(f"gpu_check: {len(runner.results)} jobs in {runner.elapsed():.0f} s; report {args.out}/gpu-report.md"
          + (f"; {NO_GPU}: compile-only, exit 2" if not gpu else f"; exit {status}"), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
