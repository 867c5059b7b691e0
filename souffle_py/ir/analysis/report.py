"""Human and machine views of a ProgramAnalysis: `souffle analyze` prints summary(), `--json` writes to_json()."""

from __future__ import annotations

from collections import Counter

from souffle_py.ir.analysis.element_level import DATA_DEPENDENT, ONE_TO_MANY, ONE_TO_ONE
from souffle_py.ir.analysis.program_analysis import ONE_RELIES_ON_MANY, ONE_RELIES_ON_ONE, ProgramAnalysis
from souffle_py.ir.analysis.tensor_level import CI_THRESHOLD


def counts(analysis: ProgramAnalysis) -> dict:
    """The headline numbers: TEs by class and dependence, accesses by kind, flops, memory."""
    tes = list(analysis.tes.values())
    accesses = [a for t in tes for a in t.accesses]
    klass, dependence, kind = Counter(t.klass for t in tes), Counter(t.dependence for t in tes), \
        Counter(a.kind for a in accesses)
    resident = Counter()
    for info in analysis.tensors.values():
        if info.producer is None:
            resident[info.kind] += info.bytes
    return {
        "tes": len(tes),
        "ci": klass["CI"], "mi": klass["MI"],
        ONE_RELIES_ON_ONE: dependence[ONE_RELIES_ON_ONE], ONE_RELIES_ON_MANY: dependence[ONE_RELIES_ON_MANY],
        DATA_DEPENDENT: dependence[DATA_DEPENDENT],
        "accesses": len(accesses),
        "access_kinds": {k: kind[k] for k in (ONE_TO_ONE, ONE_TO_MANY, DATA_DEPENDENT)},
        "affine_accesses": sum(a.M is not None for a in accesses),
        "flops": sum(t.flops for t in tes), "ci_flops": sum(t.flops for t in tes if t.klass == "CI"),
        "peak_live_bytes": analysis.peak.bytes, "param_bytes": resident["param"], "input_bytes": resident["input"],
    }


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _names(names, limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def summary(analysis: ProgramAnalysis, top: int = 5) -> str:
    c = counts(analysis)
    peak = analysis.peak
    kinds = c["access_kinds"]
    fusable = [s for s in analysis.spatial_reuse if len(s.independent) > 1]  # horizontal-fusion candidates
    lines = [
        f"TEs: {c['tes']}  (CI {c['ci']}, MI {c['mi']}; CI = contraction or >= {CI_THRESHOLD:g} flop/byte)",
        f"dependence: one-relies-on-one {c[ONE_RELIES_ON_ONE]}, one-relies-on-many {c[ONE_RELIES_ON_MANY]}, "
        f"data-dependent {c[DATA_DEPENDENT]}",
        f"accesses: {c['accesses']}  (one-to-one {kinds[ONE_TO_ONE]}, of which affine (M, c) {c['affine_accesses']}; "
        f"one-to-many {kinds[ONE_TO_MANY]}; data-dependent {kinds[DATA_DEPENDENT]})",
        f"work: {c['flops'] / 1e9:.3f} GFLOP, {100 * c['ci_flops'] / max(c['flops'], 1):.1f}% in CI TEs",
        f"memory: peak live tensors {_size(peak.bytes)} at step {peak.step} ({peak.te}); "
        f"params {_size(c['param_bytes'])}, inputs {_size(c['input_bytes'])}",
        f"spatial reuse: {len(analysis.spatial_reuse)} tensors read by several TEs, {len(fusable)} by independent "
        "ones; largest sets (independent readers):",
    ]
    lines += [f"  {s.tensor} ({_size(s.bytes)}): {_names(s.independent)}"
              + (f"  [+{len(s.readers) - len(s.independent)} dependent]" if len(s.readers) > len(s.independent) else "")
              for s in fusable[:top]]
    lines.append(f"temporal reuse: {len(analysis.temporal_reuse)} tensors re-read by dependent TEs; largest:")
    lines += [f"  {t.tensor} ({t.kind}, {_size(t.bytes)}): read by {len(t.readers)} TEs, {t.rereads} re-reads over "
              f"{t.span} steps -> {_size(t.saved_bytes)} of reloads avoidable"
              for t in analysis.temporal_reuse[:top]]
    if analysis.back_edges:
        lines.append(f"recurrences: {len(analysis.back_edges)} states carried from step t - 1 (a time loop each; "
                     "the weights its TEs read stay in cache across the steps):")
        lines += [f"  {state} <- {source}[t - 1]" + _step_weights(analysis, state)
                  for state, source in list(analysis.back_edges.items())[:top]]
    return "\n".join(lines)


def _step_weights(analysis: ProgramAnalysis, state: str) -> str:
    """The parameters the state's readers read at every time step (re-read T - 1 times from cache)."""
    steps = analysis.tensors[state].shape[0]
    weights = sorted({a.tensor for reader in analysis.tensors[state].readers for a in analysis.tes[reader].accesses
                      if analysis.tensors[a.tensor].kind == "param" and a.kind == ONE_TO_MANY})
    if not weights:
        return ""
    size = sum(analysis.tensors[w].bytes for w in weights)
    return f"; with it every step reads {', '.join(weights)} ({_size(size)}): {steps - 1} re-reads"


def to_json(analysis: ProgramAnalysis) -> dict:
    """The full analysis as JSON-ready data (maps as isl strings, M and c as nested lists)."""
    def access(a):
        return {"tensor": a.tensor, "kind": a.kind, "map": a.text, "single_valued": a.single_valued,
                "injective": a.injective, "exact": a.exact,
                "M": None if a.M is None else a.M.tolist(), "c": None if a.c is None else a.c.tolist()}

    def te_record(t):
        return {"name": t.name, "origin": t.origin, "index": t.index, "shape": list(t.shape), "dtype": t.dtype,
                "bytes": t.bytes, "points": t.points, "flops": t.flops, "loads": t.loads, "stores": t.stores,
                "traffic_bytes": t.traffic_bytes, "intensity": t.intensity, "contraction": t.contraction,
                "class": t.klass, "dependence": t.dependence, "accesses": [access(a) for a in t.accesses]}

    return {
        "summary": counts(analysis),
        "ci_threshold_flops_per_byte": CI_THRESHOLD,
        "tes": [te_record(t) for t in analysis.tes.values()],
        "tensors": [{"name": i.name, "shape": list(i.shape), "dtype": i.dtype, "bytes": i.bytes, "kind": i.kind,
                     "producer": i.producer, "readers": list(i.readers), "live": list(i.live)}
                    for i in analysis.tensors.values()],
        "spatial_reuse": [{"tensor": s.tensor, "bytes": s.bytes, "readers": list(s.readers),
                           "independent": list(s.independent)} for s in analysis.spatial_reuse],
        "temporal_reuse": [{"tensor": t.tensor, "kind": t.kind, "bytes": t.bytes, "readers": list(t.readers),
                            "rereads": t.rereads, "span": t.span, "saved_bytes": t.saved_bytes}
                           for t in analysis.temporal_reuse],
        "peak": {"bytes": analysis.peak.bytes, "step": analysis.peak.step, "te": analysis.peak.te},
        "back_edges": [{"state": state, "source": source, "map": str(analysis.state_map(state))}
                       for state, source in analysis.back_edges.items()],
    }
