"""Measure souffle-py on the corpus of real exports (scripts/corpus.py) side by side with ONNX Runtime and
OpenVINO (float32 hint), one table for the whole corpus plus a JSON file to compare runs.

    python scripts/bench_corpus.py [--corpus DIR] [--only SUBSTRING ...] [--exporters classic dynamo]
                                   [--profile] [--cuda one|all|none] [--json FILE] [--output FILE.md]
    python scripts/bench_corpus.py --cuda-only [--cuda all] [--paper [DIR]] [--only ...]
    python scripts/bench_corpus.py --compare OLD.json NEW.json

Per export, in a process of its own (a crash or a timeout is one failed row, the run goes on): compile with
souffle-py (timed), check every output against ONNX Runtime elementwise relative to the output's scale
(max |souffle - ORT| / max |ORT| <= 1e-3: random-initialized CNNs reach 1e12, where float32 rounding alone
differs by 1e6), time souffle-py, ONNX Runtime and OpenVINO on the same threads (TVM_NUM_THREADS, default
2) in interleaved rounds (benchmark.py), medians; with --profile, for an export slower than ONNX Runtime
by --slow or more, its slowest stages inside its merged kernels (CompiledModel.profile(stages=True)); and
compile it for target="cuda" (compile only: kernel launches and grid syncs per inference) for one export
per model (--cuda one, the default), each (all) or none: launches per inference, grid kernels, grid syncs,
the share of TEs inside grid kernels, launches per Softmax node (attention layer) and every fallback of the
grid kernels by kernel and reason (backends/cuda/report.py). --cuda-only compiles for CUDA alone (no CPU
compile, check or timing), --paper takes the six paper models (models/, paper size) instead of the corpus.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("TVM_NUM_THREADS", "2")
os.environ.setdefault("SOUFFLE_COMPILE_CACHE", "0")  # compile times are measured: every compile a real one

SCALE_TOLERANCE = 1e-3  # max |souffle - ORT| over max |ORT|, per output
DEFAULT_CORPUS = os.path.join(os.environ.get("SOUFFLE_CACHE", ".souffle_cache"), "corpus")
SOUFFLE, ORT, OPENVINO = "souffle-py", "ONNX Runtime", "OpenVINO f32"
NATIVE = "souffle-py host build"  # with --target: the same export compiled for this machine, timed beside it


# --- one export, in its own process ---------------------------------------------------------------------------
def measure_export(path: str, repeat: int, profile: bool, slow: float, top_stages: int, cuda: bool,
                   cpu: bool = True, target: str | None = None) -> dict:
    import numpy as np

    import souffle_py
    from souffle_py.backends import backend_for
    from souffle_py.baselines import OnnxRuntimeModel
    from souffle_py.baselines import OpenVinoModel, openvino_available
    from souffle_py.benchmark import _interleaved_medians, busy_cores

    result: dict = {"threads": int(os.environ["TVM_NUM_THREADS"])}
    if not cpu:
        return {**result, "cuda": cuda_figures(path)}
    start = time.perf_counter()
    model = souffle_py.optimize(path, target=target or "llvm", quiet=True)
    result["compile_s"] = time.perf_counter() - start
    result["kernels"], result["distinct_kernels"] = model.num_kernels, model.distinct_kernels
    result["flops"] = sum(call.flops for call in model.plan.calls)
    feeds = model.random_feeds(seed=0)
    systems = {ORT: OnnxRuntimeModel(path), SOUFFLE: model}
    if target:  # another CPU this host runs (an AVX2 build here): the host's own build timed beside it
        result["target"] = target
        systems[NATIVE] = souffle_py.optimize(path, quiet=True)
    if openvino_available():
        try:
            systems[OPENVINO] = OpenVinoModel(path, precision="f32")
        except Exception as exc:  # its failure is a row entry, not the end of the run
            result["openvino_error"] = str(exc)[:300]
    expected = systems[ORT].run(feeds)
    result["error_vs_scale"] = {name: scaled_error(system.run(feeds), expected)
                                for name, system in systems.items() if name != ORT}
    # an all-zero reference (a zero-initialized classifier) would match anything: that is no check
    result["zero_output"] = all(not np.any(value) for value in expected.values())
    result["matches"] = result["error_vs_scale"][SOUFFLE] <= SCALE_TOLERANCE and not result["zero_output"]
    result["busy_cores"] = busy_cores()
    result["median_ms"] = _interleaved_medians(systems, feeds, repeat, warmup=2, block=5)
    ratio = result["median_ms"][SOUFFLE] / result["median_ms"][ORT]
    if profile and ratio >= slow:
        result["profile"] = stage_summary(model, feeds, backend_for("llvm").peak_gflops(model.single_threaded),
                                          top_stages)
    del systems, model
    if cuda:
        result["cuda"] = cuda_figures(path)
    return result


def cuda_figures(path: str) -> dict:
    """Compiled for target="cuda" (compile only): launches per inference, grid kernels, grid syncs, the share
    of TEs inside grid kernels and the fallbacks (backends/cuda/report.py), the Softmax nodes (attention
    layers) of the export, or the error."""
    import onnx

    import souffle_py
    from souffle_py.backends.cuda.report import grid_figures

    start = time.perf_counter()
    try:
        gpu = souffle_py.optimize(path, target="cuda", quiet=True)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"}
    softmax = sum(1 for node in onnx.load(path, load_external_data=False).graph.node if node.op_type == "Softmax")
    return {"kernels": gpu.num_kernels, "grid_syncs": gpu.grid_syncs, "compile_s": time.perf_counter() - start,
            **grid_figures(gpu.plan).as_dict(), "softmax": softmax}


def scaled_error(outputs: dict, expected: dict) -> float:
    """The largest elementwise |difference| over the largest |reference value|, over all outputs (inf for
    a NaN or a missing output)."""
    import numpy as np

    worst = 0.0
    for name, reference in expected.items():
        got = outputs.get(name)
        if got is None or got.shape != reference.shape:
            return math.inf
        reference = reference.astype(np.float64)
        scale = float(np.max(np.abs(reference))) if reference.size else 0.0
        diff = float(np.max(np.abs(got.astype(np.float64) - reference))) if reference.size else 0.0
        if not math.isfinite(diff):
            return math.inf
        worst = max(worst, diff / scale if scale > 0 else diff)
    return worst


def stage_summary(model, feeds, peak: float | None, top: int) -> dict:
    """The slowest stage groups over all kernel calls, and how much of the kernels' time the stages cover."""
    rows = model.profile(feeds, repeat=5, stages=True)
    kernels_ms = sum(r["median_ms"] for r in rows) or 1.0
    groups = [{**g, "kernel": r["kernel"]} for r in rows for g in r["stages"]]
    groups.sort(key=lambda g: -g["median_ms"])
    slowest = [{"kernel": g["kernel"], "ms": g["median_ms"], "share": g["median_ms"] / kernels_ms,
                "rule": g["rule"], "gflop_s": g["gflop_s"], "peak": g["gflop_s"] / peak if peak and g["flops"] else None,
                "stages": g["stages"], "nodes": g["nodes"]} for g in groups[:top]]
    return {"kernels_ms": kernels_ms, "stages_ms": sum(r["stages_ms"] for r in rows),
            "instrumented_ms": sum(r["instrumented_ms"] for r in rows), "paired_ms": sum(r["paired_ms"] for r in rows),
            "peak_gflops": peak, "slowest": slowest}


# --- the whole corpus --------------------------------------------------------------------------------------------
def corpus_exports(corpus: str, only, exporters) -> list[dict]:
    manifest = os.path.join(corpus, "manifest.json")
    if not os.path.exists(manifest):
        raise SystemExit(f"{manifest} does not exist: export the corpus first (python scripts/corpus.py --out "
                         f"{corpus}, or make corpus)")
    with open(manifest) as f:
        exports = json.load(f)["exports"]
    return [e for e in exports if e["exporter"] in exporters and (not only or any(o in e["name"] for o in only))]


PAPER_MODELS = ("bert", "efficientnet", "lstm", "mmoe", "resnext", "swin")


def paper_exports(folder: str, only) -> list[dict]:
    """The paper models at paper size (models/, seeded), written into `folder` once, as corpus entries."""
    from models.registry import build_model
    import onnx

    os.makedirs(folder, exist_ok=True)
    exports = []
    for name in PAPER_MODELS:
        if only and not any(o in name for o in only):
            continue
        file = f"{name}.onnx"
        if not os.path.exists(os.path.join(folder, file)):
            onnx.save(build_model(name), os.path.join(folder, file))
        exports.append({"name": name, "library": "models", "exporter": "models", "status": "ok", "file": file})
    return exports


def run_corpus(args) -> dict:
    if args.paper:
        args.corpus, args.cuda = args.paper, "all"
        exports = paper_exports(args.paper, args.only)
    else:
        exports = corpus_exports(args.corpus, args.only, args.exporters)
    if args.cuda_only and args.cuda == "none":
        raise SystemExit("--cuda-only needs --cuda one or all")
    cuda_for = set()
    if args.cuda != "none":
        for e in exports:  # --cuda one: the dynamo export where it exported, else the classic one
            if e["status"] == "ok" and (args.cuda == "all" or not any(
                    x["name"] == e["name"] and x["status"] == "ok" and x["exporter"] == "dynamo" and x is not e
                    for x in exports)):
                cuda_for.add((e["name"], e["exporter"]))
    results = []
    started = time.time()
    for i, e in enumerate(exports):
        row = {"name": e["name"], "library": e["library"], "exporter": e["exporter"], "nodes": e.get("nodes")}
        if e["status"] != "ok":
            row["error"] = f"export failed: {e['error'][:200]}"
            results.append(row)
            continue
        print(f"[{i + 1}/{len(exports)}] {e['name']} ({e['exporter']}) ...", flush=True)
        row.update(run_child(os.path.join(args.corpus, e["file"]), args, (e["name"], e["exporter"]) in cuda_for))
        print("  " + (cuda_row(row.get("cuda", {})) if args.cuda_only else one_line(row)), flush=True)
        results.append(row)
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit(), "host": host_description(), "threads": int(os.environ["TVM_NUM_THREADS"]),
            "repeat": args.repeat, "wall_s": time.time() - started, "target": args.target or "llvm",
            "results": results}


def run_child(path: str, args, cuda: bool) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    command = [sys.executable, os.path.abspath(__file__), "--one", path, "--result", out, "--repeat",
               str(args.repeat), "--slow", str(args.slow), "--top-stages", str(args.top_stages)]
    command += ["--profile"] if args.profile else []
    command += ["--with-cuda"] if cuda else []
    command += ["--cuda-only"] if args.cuda_only else []
    command += ["--target", args.target] if args.target else []
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
        if done.returncode != 0 or not os.path.getsize(out):
            lines = [line for line in (done.stderr or done.stdout).strip().splitlines() if line.strip()]
            return {"error": (lines[-1] if lines else f"exit status {done.returncode}")[:300]}
        with open(out) as f:
            return json.load(f)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout} s"}
    finally:
        os.remove(out)


def one_line(row: dict) -> str:
    if "median_ms" not in row:
        return f"FAILED: {row.get('error', '?')}"
    ms = row["median_ms"]
    text = f"compile {row['compile_s']:.1f} s, souffle-py {ms[SOUFFLE]:.3f} ms, {ratio(row, ORT):.2f}x ORT"
    if OPENVINO in ms:
        text += f", {ratio(row, OPENVINO):.2f}x OpenVINO"
    if NATIVE in ms:
        text += f", {ratio(row, NATIVE):.2f}x the host build"
    return text + f", error/scale {row['error_vs_scale'][SOUFFLE]:.1e}" + ("" if row["matches"] else " MISMATCH")


def ratio(row: dict, system: str) -> float | None:
    ms = row.get("median_ms", {})
    return ms[SOUFFLE] / ms[system] if SOUFFLE in ms and system in ms and ms[system] > 0 else None


def geomean(values) -> float | None:
    values = [v for v in values if v]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def format_report(report: dict, slow: float) -> str:
    results = report["results"]
    lines = [f"Corpus run {report['date']} at commit {report['commit']} on {report['host']}"
             + (f", souffle-py compiled for {report['target']}" if report.get("target", "llvm") != "llvm" else "")
             + ", "
             f"{report['threads']} threads each, {report['repeat']} timed runs per system (interleaved rounds, "
             f"medians); wall time {report['wall_s'] / 60:.1f} min.", "",
             "| export | exporter | compile (s) | souffle-py (ms) | ORT (ms) | OpenVINO f32 (ms) | vs ORT | vs OpenVINO "
             "| error / scale | CPU kernels | " + CUDA_HEADER + " |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * CUDA_COLUMNS]
    for r in results:
        cuda_cells = cuda_row(r.get("cuda", {}))
        if "median_ms" not in r:
            lines.append(f"| {r['name']} | {r['exporter']} | failed: {r.get('error', '?')[:150]} | | | | | | | | "
                         + cuda_cells + " |")
            continue
        ms = r["median_ms"]
        vs_ov = ratio(r, OPENVINO)
        lines.append(f"| {r['name']} | {r['exporter']} | {r['compile_s']:.1f} | {ms[SOUFFLE]:.3f} | {ms[ORT]:.3f} | "
                     f"{ms[OPENVINO]:.3f} | " if OPENVINO in ms else
                     f"| {r['name']} | {r['exporter']} | {r['compile_s']:.1f} | {ms[SOUFFLE]:.3f} | {ms[ORT]:.3f} | | ")
        lines[-1] += (f"{ratio(r, ORT):.2f}x | {'' if vs_ov is None else f'{vs_ov:.2f}x'} | "
                      f"{r['error_vs_scale'][SOUFFLE]:.1e}{'' if r['matches'] else ' ZERO' if r.get('zero_output') else ' MISMATCH'}"
                      f" | {r['kernels']} | "
                      + cuda_cells + " |")
    lines += ["", summary(results)]
    failures = [r for r in results if "median_ms" not in r or not r["matches"] or "error" in r.get("cuda", {})]
    if failures:
        lines += ["", "Failures:"]
        for r in failures:
            what = r.get("error") or ("" if "median_ms" not in r or r["matches"] else
                                      "ONNX Runtime's output is all zeros: nothing to check" if r.get("zero_output")
                                      else "mismatch")
            if "error" in r.get("cuda", {}):
                what = (what + "; " if what else "") + f"CUDA: {r['cuda']['error']}"
            lines.append(f"- {r['name']} ({r['exporter']}): {what}")
    profiled = [r for r in results if r.get("profile")]
    if profiled:
        lines += ["", f"Slowest stages of the exports at least {slow:.2f}x ONNX Runtime (profile(stages=True); "
                      f"share: of the inference's kernel time; peak: of the measured FMA peak):"]
        for r in profiled:
            p = r["profile"]
            kernels_ms = p.get("paired_ms", p["kernels_ms"])  # measured alternating with the instrumented runs
            lines += ["", f"{r['name']} ({r['exporter']}), {ratio(r, ORT):.2f}x ORT: stages sum "
                          f"{p['stages_ms']:.3f} ms of the kernels' {kernels_ms:.3f} ms "
                          f"({p['stages_ms'] / kernels_ms:.0%})"]
            for s in p["slowest"]:
                peak = f", {s['peak']:.0%} of peak" if s.get("peak") is not None else ""
                lines.append(f"- {s['ms']:.3f} ms ({s['share']:.0%}) {s['rule']} at {s['gflop_s']:.1f} GFLOP/s{peak}: "
                             f"{', '.join(s['stages'])[:80]} <- {', '.join(s['nodes'])[:100]} [{s['kernel']}]")
    return "\n".join(lines)


CUDA_HEADER = ("CUDA launches | grid kernels | grid syncs | TEs in grid kernels | launches per Softmax | fallbacks "
               "| CUDA compile (s)")
CUDA_COLUMNS = CUDA_HEADER.count("|") + 1


def cuda_row(cuda: dict) -> str:
    """The CUDA cells of a row: launches per inference, grid kernels, grid syncs, the share of TEs inside grid
    kernels, launches per Softmax node (per attention layer of a transformer), fallbacks, compile time."""
    if not cuda:
        return " | " * (CUDA_COLUMNS - 1)
    if "error" in cuda:
        return "failed" + " | " * (CUDA_COLUMNS - 1)
    per_softmax = f"{cuda['launches'] / cuda['softmax']:.2f}" if cuda.get("softmax") else ""
    return (f"{cuda['launches']} | {cuda['grid_kernels']} | {cuda['grid_syncs']} | {cuda['share']:.0%} | "
            f"{per_softmax} | {len(cuda['fallbacks'])} | {cuda['compile_s']:.1f}")


def format_cuda_report(report: dict) -> str:
    """The CUDA column alone (--cuda-only): compile-only figures per export, then every fallback."""
    results = report["results"]
    lines = [f"CUDA compile-only run {report['date']} at commit {report['commit']} on {report['host']}; wall time "
             f"{report['wall_s'] / 60:.1f} min.", "", "| export | exporter | " + CUDA_HEADER + " |",
             "|---|---|" + "---:|" * CUDA_COLUMNS]
    for r in results:
        cuda = r.get("cuda") or ({"error": r["error"]} if "error" in r else {})
        lines.append(f"| {r['name']} | {r['exporter']} | {cuda_row(cuda)} |")
    done = [r["cuda"] for r in results if "launches" in r.get("cuda", {})]
    if done:
        lines += ["", f"{len(done)} of {len(results)} compiled; {sum(1 for c in done if c['fallbacks'])} with a "
                      f"fallback; {sum(1 for c in done if c['share'] >= 0.9)} with at least 90% of their TEs in grid "
                      f"kernels; compile total {sum(c['compile_s'] for c in done) / 60:.1f} min."]
    failed = [(r, r.get("cuda", {}).get("error") or r.get("error")) for r in results
              if "launches" not in r.get("cuda", {})]
    fallbacks = [(r, name, reason) for r in results for name, reason in r.get("cuda", {}).get("fallbacks", [])]
    if failed or fallbacks:
        lines += ["", "Failures and fallbacks:"]
        lines += [f"- {r['name']} ({r['exporter']}): {error}" for r, error in failed]
        lines += [f"- {r['name']} ({r['exporter']}), {name}: {reason}" for r, name, reason in fallbacks]
    return "\n".join(lines)


def summary(results: list[dict]) -> str:
    measured = [r for r in results if "median_ms" in r]
    lines = [f"{len(measured)} of {len(results)} exports compiled and ran; "
             f"{sum(1 for r in measured if r['matches'])} match ONNX Runtime (error/scale <= {SCALE_TOLERANCE:g})."]
    for system in (ORT, OPENVINO, NATIVE):
        ratios = [(ratio(r, system), r) for r in measured if ratio(r, system)]
        if ratios:
            worst, row = max(ratios, key=lambda x: x[0])
            lines.append(f"souffle-py / {system}: geomean {geomean(x for x, _ in ratios):.2f}x, worst {worst:.2f}x "
                         f"({row['name']}, {row['exporter']}), {sum(1 for x, _ in ratios if x > 1.0)} of {len(ratios)} "
                         f"above 1.0x")
    compile_s = [r["compile_s"] for r in measured]
    if compile_s:
        lines.append(f"CPU compile time: total {sum(compile_s) / 60:.1f} min, median {sorted(compile_s)[len(compile_s) // 2]:.1f} s, "
                     f"max {max(compile_s):.1f} s")
    cuda = [r["cuda"] for r in results if "compile_s" in r.get("cuda", {})]
    if cuda:
        lines.append(f"CUDA (compile only): {len(cuda)} compiled, total {sum(c['compile_s'] for c in cuda) / 60:.1f} min")
    return "\n".join(lines)


def compare(old_path: str, new_path: str) -> str:
    with open(old_path) as f:
        old = {(r["name"], r["exporter"]): r for r in json.load(f)["results"]}
    with open(new_path) as f:
        new = json.load(f)["results"]
    lines = [f"| export | exporter | vs ORT before | vs ORT after | change |", "|---|---|---:|---:|---:|"]
    pairs = []
    for r in new:
        before, after = ratio(old.get((r["name"], r["exporter"]), {}), ORT), ratio(r, ORT)
        if before and after:
            pairs.append((before, after))
        lines.append(f"| {r['name']} | {r['exporter']} | {'' if before is None else f'{before:.2f}x'} | "
                     f"{'' if after is None else f'{after:.2f}x'} | "
                     f"{'' if not (before and after) else f'{after / before:.2f}'} |")
    if pairs:
        lines.append(f"\ngeomean vs ORT over {len(pairs)} exports in both: {geomean(b for b, _ in pairs):.2f}x -> "
                     f"{geomean(a for _, a in pairs):.2f}x")
    return "\n".join(lines)


def git_commit() -> str:
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def host_description() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{model}, {os.cpu_count()} cores"


def main(argv) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", default=DEFAULT_CORPUS, help=f"the exported corpus (default {DEFAULT_CORPUS})")
    parser.add_argument("--only", nargs="+", help="exports whose name contains one of these")
    parser.add_argument("--exporters", nargs="+", default=["classic", "dynamo"], choices=["classic", "dynamo"])
    parser.add_argument("--repeat", type=int, default=10, help="timed runs per system (median reported)")
    parser.add_argument("--profile", action="store_true", help="the slowest stages of each slow export")
    parser.add_argument("--slow", type=float, default=1.2, help="--profile: exports this much slower than ORT")
    parser.add_argument("--top-stages", type=int, default=5)
    parser.add_argument("--cuda", choices=["one", "all", "none"], default="one",
                        help="compile for target='cuda' too: one export per model (default), each, or none")
    parser.add_argument("--cuda-only", action="store_true",
                        help="compile for target='cuda' only (no CPU compile, check or timing): the CUDA column alone")
    parser.add_argument("--paper", nargs="?", const=os.path.join(os.environ.get("SOUFFLE_CACHE", ".souffle_cache"), "paper"),
                        metavar="DIR", help="the paper models (models/, paper size; written into DIR once) instead "
                        "of the corpus")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per export")
    parser.add_argument("--target", help="compile souffle-py for this CPU (e.g. avx2, \"llvm -mcpu=haswell\"; one this "
                                         "host runs) and time the host's own build beside it (docs/targets.md)")
    parser.add_argument("--json", help="where the results go (JSON; default corpus_bench.json beside the corpus "
                        "folder)")
    parser.add_argument("--output", help="also write the table to this markdown file")
    parser.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"), help="compare two JSON results and exit")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--with-cuda", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.compare:
        print(compare(*args.compare))
        return 0
    if args.one:
        result = measure_export(args.one, args.repeat, args.profile, args.slow, args.top_stages,
                                args.with_cuda or args.cuda_only, cpu=not args.cuda_only, target=args.target)
        with open(args.result, "w") as f:
            json.dump(result, f)
        return 0
    # beside the corpus measured (an exported corpus elsewhere than $SOUFFLE_CACHE's ended the run at its
    # last line: the default folder did not exist)
    args.json = os.path.abspath(args.json or os.path.join(args.paper or args.corpus, os.pardir,
                                                          "paper_bench.json" if args.paper else "corpus_bench.json"))
    report = run_corpus(args)
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    text = format_cuda_report(report) if args.cuda_only else format_report(report, args.slow)
    print("\n" + text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    print(f"\nresults in {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
