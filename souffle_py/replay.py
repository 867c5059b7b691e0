"""Process replay: the scheduled TIR of a model's kernels written to a folder, and two such folders diffed,
so that a change to a pass or a schedule rule shows what it changed in the code generated for real models
(tinygrad's process replay, for kernels). `scripts/replay.py` records and compares whole model sets.

A record is one folder per model: each distinct kernel function's scheduled TIR as TVMScript
(`<function>.tir`) and the model's `describe()` (`describe.txt`: kernel calls, TEs, cut reasons).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path


def record_model(model, folder, **options) -> int:
    """Compile `model` (path or ModelProto; never from the compile cache) and write its kernels' scheduled
    TIR and its description into `folder`; the number of kernel functions written."""
    import souffle_py

    compiled = souffle_py.optimize(model, quiet=True, cache=False, **options)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.tir"):
        old.unlink()
    for name, func in compiled.scheduled_functions.items():
        (folder / f"{name}.tir").write_text(func.script())
    (folder / "describe.txt").write_text(compiled.describe() + "\n")
    return len(compiled.scheduled_functions)


@dataclass
class ModelDiff:
    """What differs for one model between two records: kernels only in one, kernels whose TIR differs
    (name -> unified diff), and whether the descriptions differ."""

    model: str
    only_before: list[str] = field(default_factory=list)
    only_after: list[str] = field(default_factory=list)
    changed: dict[str, str] = field(default_factory=dict)
    description: str = ""

    def __bool__(self) -> bool:
        return bool(self.only_before or self.only_after or self.changed or self.description)


STRUCTURE = ("for ", "with T.sblock", "T.reads", "T.writes", "T.attr")


def structure(tir: str) -> str:
    """A kernel's loop and block skeleton: its loops (with their kinds: parallel, vectorized, unrolled),
    blocks and their read and write regions, without the values computed (what a change to an
    expression, not to a schedule, leaves alone)."""
    return "\n".join(line for line in tir.splitlines() if line.strip().startswith(STRUCTURE))


def diff_records(before, after, structure_only: bool = False) -> list[ModelDiff]:
    """Per model recorded in both folders (or in one), what changed (`structure_only`: in the loop and block
    skeletons alone); models without change are left out."""
    before, after = Path(before), Path(after)
    names = sorted({p.name for p in before.iterdir() if p.is_dir()} | {p.name for p in after.iterdir() if p.is_dir()})
    found = []
    for name in names:
        a, b = before / name, after / name
        d = ModelDiff(name)
        view = structure if structure_only else (lambda text: text)
        kernels_a = {p.stem: view(p.read_text()) for p in a.glob("*.tir")} if a.is_dir() else {}
        kernels_b = {p.stem: view(p.read_text()) for p in b.glob("*.tir")} if b.is_dir() else {}
        d.only_before = sorted(set(kernels_a) - set(kernels_b))
        d.only_after = sorted(set(kernels_b) - set(kernels_a))
        for kernel in sorted(set(kernels_a) & set(kernels_b)):
            if kernels_a[kernel] != kernels_b[kernel]:
                d.changed[kernel] = _unified(kernels_a[kernel], kernels_b[kernel], kernel)
        describe_a, describe_b = (_read(x / "describe.txt") for x in (a, b))
        if describe_a != describe_b:
            d.description = _unified(describe_a, describe_b, "describe.txt")
        if d:
            found.append(d)
    return found


def format_diffs(diffs: list[ModelDiff], lines_per_kernel: int = 40) -> str:
    """A report: per changed model, its kernels added, removed and changed (each diff cut to
    `lines_per_kernel` lines), then its description's diff."""
    if not diffs:
        return "no kernel changed"
    out = [f"{len(diffs)} models changed"]
    for d in diffs:
        out.append(f"\n## {d.model}: {len(d.changed)} kernels changed, {len(d.only_after)} new, "
                   f"{len(d.only_before)} gone")
        out += [f"  gone: {k}" for k in d.only_before] + [f"  new: {k}" for k in d.only_after]
        for kernel, text in d.changed.items():
            lines = text.splitlines()
            out.append(f"### {kernel} ({len(lines)} diff lines)")
            out += lines[:lines_per_kernel] + (["  ..."] if len(lines) > lines_per_kernel else [])
        if d.description:
            out += ["### describe()", d.description]
    return "\n".join(out)


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def _unified(a: str, b: str, name: str) -> str:
    return "".join(difflib.unified_diff(a.splitlines(True), b.splitlines(True), f"before/{name}", f"after/{name}",
                                        n=1))
