"""The TE transformation pipeline: named passes, a switch per pass, and the paper's ablation presets.

    program, records = PassPipeline.from_spec("V2").run(program)
    for record in records:
        print(record.line())          # "vertical: 612 -> 301 TEs in 1.9 s: ..."

Passes run in the fixed order of ORDER whatever order a spec names them in: vertical composition first,
so horizontal grouping sees one TE per chain (BERT's Q/K/V bias epilogues then combine like their GEMMs);
the other order would group every reshape and transpose of a chain separately. Each pass gets a fresh
analysis of its input program.

Presets (the paper's Table 4): V0 = no transformation (TVM + schedules), V1 = + horizontal,
V2 = + vertical (both passes).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from souffle_py.errors import SouffleError
from souffle_py.failures import rule_failed
from souffle_py.program import TEProgram
from te_passes.analysis import ProgramAnalysis, analyze
from te_passes.horizontal import horizontal
from te_passes.vertical import vertical

log = logging.getLogger(__name__)

PASSES: dict[str, Callable] = {"vertical": vertical, "horizontal": horizontal}
ORDER = ("vertical", "horizontal")
PRESETS = {"none": (), "V0": (), "V1": ("horizontal",), "V2": ("horizontal", "vertical"), "all": ORDER}


@dataclass(frozen=True)
class PassRecord:
    """What one pass did: TE counts around it, its own time (analysis excluded) and its log object."""

    name: str
    tes_before: int
    tes_after: int
    seconds: float
    analysis_seconds: float
    summary: str
    log: object

    def line(self) -> str:
        return (f"{self.name}: {self.tes_before} -> {self.tes_after} TEs in {self.seconds:.2f} s "
                f"(+{self.analysis_seconds:.2f} s analysis): {self.summary}")


@dataclass(frozen=True)
class _Skipped:
    """The log of a pass that raised: what went wrong, in place of the pass's own summary."""

    text: str

    def summary(self) -> str:
        return self.text


@dataclass(frozen=True)
class PassPipeline:
    """The enabled passes (a subset of ORDER, kept in that order)."""

    enabled: tuple[str, ...] = ORDER

    def __post_init__(self):
        unknown = [p for p in self.enabled if p not in PASSES]
        if unknown:
            raise SouffleError(f"unknown pass(es) {unknown}; passes are {list(PASSES)}, presets {list(PRESETS)}")
        object.__setattr__(self, "enabled", tuple(p for p in ORDER if p in self.enabled))

    @classmethod
    def from_spec(cls, spec: "str | Sequence[str] | PassPipeline | None" = None) -> "PassPipeline":
        """None or "all": every pass; "none"/"V0", "V1", "V2": the ablation presets; "vertical,horizontal"
        (or a list of names): exactly those passes."""
        if isinstance(spec, PassPipeline):
            return spec
        if spec is None:
            return cls(ORDER)
        if isinstance(spec, str):
            preset = {k.lower(): v for k, v in PRESETS.items()}.get(spec.strip().lower())
            if preset is not None:
                return cls(preset)
            spec = [s.strip() for s in spec.split(",") if s.strip()]
        return cls(tuple(spec))

    def enable(self, name: str) -> "PassPipeline":
        return PassPipeline(self.enabled + (name,))

    def disable(self, name: str) -> "PassPipeline":
        return PassPipeline(tuple(p for p in self.enabled if p != name))

    def run(self, program: TEProgram, analysis: ProgramAnalysis | None = None) -> tuple[TEProgram, list[PassRecord]]:
        """The program after every enabled pass, and one record per pass. `analysis` (of `program`) saves
        the first pass from analysing it again."""
        records = []
        for name in self.enabled:
            start = time.perf_counter()
            if analysis is None:
                analysis = analyze(program)
            analysed = time.perf_counter()
            try:
                new_program, pass_log = PASSES[name](program, analysis)
            except Exception as exc:  # noqa: BLE001  (a pass must never fail a compilation)
                rule_failed(f"the {name} pass", "the program", exc, "the program unchanged")
                new_program, pass_log = program, _Skipped(f"skipped ({type(exc).__name__}: {exc})"[:300])
            done = time.perf_counter()
            record = PassRecord(name=name, tes_before=len(program.stages), tes_after=len(new_program.stages),
                                seconds=done - analysed, analysis_seconds=analysed - start,
                                summary=pass_log.summary(), log=pass_log)
            log.info("%s", record.line())
            records.append(record)
            program, analysis = new_program, None
        return program, records
