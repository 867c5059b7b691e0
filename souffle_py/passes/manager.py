"""The pass manager: every rewrite of the TE program is a registered `Pass`, run in its target's order.

A pass is a name, the group it belongs to, the level it rewrites (the ONNX graph before lowering, or the TE
program after it), the facts it requires and provides, and a function of the program and the `PassContext`. Each target lists its passes once, in order (passes/cpu.py, passes/cuda.py);
`run_passes` runs the enabled ones under one policy: a pass that raises leaves the program as it was, with
a warning naming it (failures.rule_failed; strict mode raises), a pass whose required fact no earlier pass
provided is skipped and says why, every pass is logged with its TE counts and time, and optional checks
compare each pass's output with its input: `check="isl"` (or SOUFFLE_CHECK_PASSES=isl) the input elements
each output element depends on (te_passes/footprints.py), `check="numeric"` the outputs on random feeds
(te_passes/check.py; ONNX Runtime for ONNX-level passes), `"isl,numeric"` both; a mismatch is a failure of
that pass.

`passes=` selects by name (`select`): the paper's ablation presets (V0 = the target's lowering alone: its
layouts, precision and restructuring, which TVM's own pipeline has too; V1 = + the horizontal
transformations; V2 = "all" = + the vertical ones), pass names and group names, "-name" switching one off.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from souffle_py.errors import InputError, SouffleError, TargetError
from souffle_py.failures import rule_failed
from souffle_py.ir.program import TEProgram

log = logging.getLogger("souffle_py.passes")
CHECK_ENV = "SOUFFLE_CHECK_PASSES"

# groups: the SOUFFLE transformations the ablation switches (horizontal, vertical), and the lowering to a
# target (layout, precision; restructure: for merged kernels only)
GROUPS = ("horizontal", "vertical", "precision", "layout", "restructure")
LEVELS = ("onnx", "te")
CHECKS = ("isl", "numeric")
PRESETS = {"v0": ("precision", "layout", "restructure"), "none": ("precision", "layout", "restructure"),
           "v1": ("horizontal", "precision", "layout", "restructure"), "v2": GROUPS, "all": GROUPS}


@dataclass(frozen=True)
class PassContext:
    """What every pass sees: the backend (its target and hardware spec), the precision policy, whether the
    program is for merged kernels, and the optional check."""

    backend: object = None
    precision: str = "fp32"
    merge: bool = True
    check: str | None = field(default_factory=lambda: os.environ.get(CHECK_ENV) or None)

    def __post_init__(self):
        unknown = self.checks - set(CHECKS)
        if unknown:
            raise InputError(f"pass check {self.check!r}: unknown {', '.join(sorted(unknown))}; "
                             f"the checks are {', '.join(CHECKS)} (comma-separated; {CHECK_ENV} sets the default)")

    @property
    def checks(self) -> frozenset[str]:
        return frozenset(c.strip() for c in (self.check or "").split(",") if c.strip())


@dataclass(frozen=True)
class Pass:
    """One rewrite of the TE program. `run(program, context)` returns the new program, or (program, log)
    where log.summary() says what it did; `when(context)` limits it to some compiles (bf16 only, ...)."""

    name: str
    group: str
    run: Callable
    requires: tuple[str, ...] = ()
    provides: tuple[str, ...] = ()
    when: Callable[[PassContext], bool] | None = None
    merged_only: bool = False   # a rewrite for merged kernels (merge=True) only
    doc: str = ""
    level: str = "te"   # "onnx": rewrites the checked ONNX model before lowering; "te": the TE program

    def __post_init__(self):
        assert self.group in GROUPS, f"pass {self.name}: unknown group {self.group}"
        assert self.level in LEVELS, f"pass {self.name}: unknown level {self.level}"


@dataclass(frozen=True)
class PassRecord:
    """What one pass did: TE counts around it, its time, and its summary (or why it did not run)."""

    name: str
    tes_before: int   # ONNX nodes for an ONNX-level pass
    tes_after: int
    seconds: float
    summary: str
    log: object = None
    level: str = "te"

    def line(self) -> str:
        unit = "nodes" if self.level == "onnx" else "TEs"
        return f"{self.name}: {self.tes_before} -> {self.tes_after} {unit} in {self.seconds:.2f} s: {self.summary}"


def select(spec, passes: Sequence[Pass]) -> frozenset[str]:
    """The names of `passes` that `spec` enables. None, "all" or "V2": every pass; "none"/"V0", "V1": the
    ablation presets; otherwise comma-separated (or a list of) pass or group names added to V0, or a preset
    first; "-name" switches a pass or group off ("-pack_weights": every pass but that one)."""
    if spec is None:
        spec = "all"
    tokens = [t.strip() for t in (spec.split(",") if isinstance(spec, str) else spec)]
    tokens = [t for t in tokens if t]
    if not all(isinstance(t, str) for t in tokens):
        raise InputError(f"passes must be a string or a list of pass names, got {spec!r}")
    by_name = {p.name: p for p in passes}
    groups = {g: {p.name for p in passes if p.group == g} for g in GROUPS}

    def names_of(token: str) -> set[str]:
        if token in by_name:
            return {token}
        if token in groups:
            return groups[token]
        raise InputError(f"unknown pass {token!r} in passes={spec!r}; the target's passes are "
                         f"{', '.join(by_name)}; groups {', '.join(GROUPS)}; presets V0, V1, V2, all, none")

    def preset(token: str) -> set[str] | None:
        chosen = PRESETS.get(token.lower())
        return None if chosen is None else {p.name for p in passes if p.group in chosen}

    if not tokens or tokens[0].startswith("-"):
        enabled = set(by_name)
    elif tokens[0].lower() in PRESETS:
        enabled = preset(tokens.pop(0))
    else:
        enabled = preset("V0")
    for token in tokens:
        if token.startswith("-"):
            enabled -= names_of(token[1:].strip())
        else:
            enabled |= preset(token) or names_of(token)
    return frozenset(enabled)


def run_passes(program, passes: Sequence[Pass], context: PassContext, enabled: frozenset[str] | None = None,
               level: str = "te") -> tuple:
    """`program` (a TEProgram, or the onnx.ModelProto for level "onnx") after the enabled `passes` of that
    level in their order, and a record of each one that applied to this compile (skipped ones say why)."""
    scope = context.backend.scope() if context.backend is not None else contextlib.nullcontext()
    with scope:
        return _run_all(program, [p for p in passes if p.level == level], context, enabled)


def _size(program) -> int:
    return len(program.stages) if isinstance(program, TEProgram) else len(program.graph.node)


def _run_all(program, passes, context, enabled):
    provided: set[str] = set()
    records = []
    for step in passes:
        if enabled is not None and step.name not in enabled:
            continue
        if step.when is not None and not step.when(context):
            continue
        if step.merged_only and not context.merge:
            continue
        missing = [fact for fact in step.requires if fact not in provided]
        if missing:
            record = PassRecord(step.name, _size(program), _size(program), 0.0,
                                f"skipped: needs {', '.join(missing)}, which no earlier pass provided",
                                level=step.level)
        else:
            program, record, ran = _run_one(step, program, context)
            if ran:
                provided.update(step.provides)
        log.info("%s", record.line())
        records.append(record)
    return program, records


def _run_one(step: Pass, program: TEProgram, context: PassContext) -> tuple[TEProgram, PassRecord, bool]:
    start = time.perf_counter()
    try:
        result = step.run(program, context)
        new, pass_log = result if isinstance(result, tuple) else (result, None)
        if new is not program:
            _check(program, new, step.level, context.checks)
    except (InputError, TargetError):
        raise  # the user's input or target, not a bug of the pass
    except Exception as exc:  # noqa: BLE001  (the failure policy: failures.py)
        rule_failed(f"the {step.name} pass", "the program", exc, "the program unchanged")
        summary = f"skipped ({type(exc).__name__}: {exc})"[:300]
        return program, PassRecord(step.name, _size(program), _size(program), time.perf_counter() - start,
                                   summary, level=step.level), False
    summary = pass_log.summary() if pass_log is not None else ("unchanged" if new is program else "rewritten")
    return new, PassRecord(step.name, _size(program), _size(new), time.perf_counter() - start,
                           summary, pass_log, step.level), True


def _check(before, after, level: str, checks: frozenset[str]) -> None:
    if "isl" in checks and level == "te":
        from te_passes.footprints import compare_footprints

        result = compare_footprints(before, after)
        log.info("%s", result.summary())
        if result.differ:
            raise SouffleError(f"the input elements its outputs depend on changed ({result.summary()})")
    if "numeric" in checks:
        _check_numerically(before, after, level)


def _check_numerically(before, after, level: str) -> None:
    from te_passes.check import assert_same_models, assert_same_outputs

    try:
        (assert_same_models if level == "onnx" else assert_same_outputs)(before, after)
    except AssertionError as exc:
        raise SouffleError(f"its output differs from its input program's: {str(exc).strip()[:300]}") from exc
