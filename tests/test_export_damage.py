"""A damaged export is a named error at load(), never a crash or a silent wrong answer.

Every member of a tiny export is truncated and has bytes flipped at many offsets, both inside the file as
written (the tar's own bytes) and as an archive rebuilt around a damaged member; the file itself is also
truncated. Each damaged file is loaded and run in a child process (a crash must not take the test run
with it): the outcome must be a SouffleError subclass raised by load() or run(), or outputs identical to
the undamaged model's. A library built for a CPU extension this machine lacks is refused with TargetError.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile

import numpy as np
import pytest

import souffle_py
from models.registry import build_model
from souffle_py.errors import ExportError, TargetError
from souffle_py.export import PLAN, PLAN_SHA

CHILD = r"""
import hashlib, sys
import numpy as np
import souffle_py
feeds = dict(np.load(sys.argv[1]))
for path in sys.argv[2:]:
    print("CASE", path, flush=True)
    try:
        outputs = souffle_py.load(path).run(feeds)
        print("OK", hashlib.sha256(b"".join(outputs[k].tobytes() for k in sorted(outputs))).hexdigest(), flush=True)
    except souffle_py.SouffleError as exc:
        print("ERROR", type(exc).__name__, str(exc).replace("\n", " ")[:300], flush=True)
    except BaseException as exc:
        print("BARE", type(exc).__name__, str(exc).replace("\n", " ")[:300], flush=True)
"""
FRACTIONS = (0.0, 0.05, 0.3, 0.5, 0.7, 0.95)


def _digest(outputs) -> str:
    return hashlib.sha256(b"".join(outputs[k].tobytes() for k in sorted(outputs))).hexdigest()


def _flipped(data: bytes, at: int, count: int = 16) -> bytes:
    end = min(len(data), at + count)
    return data[:at] + bytes(b ^ 0xA5 for b in data[at:end]) + data[end:]


def _rebuilt(path, name: str, damage) -> bytes:
    """The archive at `path` written again with member `name`'s contents passed through `damage`."""
    out = io.BytesIO()
    with tarfile.open(path) as source, tarfile.open(fileobj=out, mode="w") as target:
        for member in source.getmembers():
            data = source.extractfile(member).read()
            if member.name == name:
                data = damage(data)
            info = tarfile.TarInfo(member.name)
            info.size = len(data)
            target.addfile(info, io.BytesIO(data))
    return out.getvalue()


def _cases(path, folder) -> dict[str, str]:
    """Damaged copies of the export at `path`: case name -> file."""
    raw = open(path, "rb").read()
    with tarfile.open(path) as archive:
        members = [(m.name, m.offset, m.offset_data, m.size) for m in archive.getmembers()]
    blobs = {}
    for name, header, start, size in members:
        for fraction in FRACTIONS:
            at = start + int(fraction * max(size - 1, 0))
            blobs[f"{name}-flip-in-file-{fraction}"] = _flipped(raw, at)
            blobs[f"{name}-cut-file-{fraction}"] = raw[:at]
            blobs[f"{name}-flip-member-{fraction}"] = _rebuilt(path, name, lambda d, f=fraction: _flipped(
                d, int(f * max(len(d) - 1, 0))))
            blobs[f"{name}-cut-member-{fraction}"] = _rebuilt(path, name, lambda d, f=fraction: d[:int(f * len(d))])
        blobs[f"{name}-flip-header"] = _flipped(raw, header + 100)
    blobs["library-cut-to-5000-bytes"] = _rebuilt(path, "kernels.so", lambda d: d[:5000])
    files = {}
    for case, blob in blobs.items():
        files[case] = os.path.join(folder, f"{len(files)}.tar")
        with open(files[case], "wb") as f:
            f.write(blob)
    return files


def _run_children(feeds_path, files: dict[str, str]) -> dict[str, str]:
    """Outcome line per case; a child that dies is recorded as CRASH for the case it was on and the
    remaining cases go to a new child."""
    by_path = {p: case for case, p in files.items()}
    pending, outcomes = list(files.values()), {}
    while pending:
        proc = subprocess.run([sys.executable, "-c", CHILD, feeds_path, *pending], capture_output=True, text=True,
                              timeout=600, env={**os.environ, "TVM_NUM_THREADS": "1"})
        current = None
        for line in proc.stdout.splitlines():
            if line.startswith("CASE "):
                current = line[5:]
            elif current is not None:
                outcomes[by_path[current]] = line
                current = None
        if current is not None:
            outcomes[by_path[current]] = f"CRASH exit {proc.returncode}: {proc.stderr.strip()[-300:]}"
        pending = [p for p in pending if by_path[p] not in outcomes]
        if proc.returncode == 0 and pending:
            raise AssertionError(f"child exited without reporting {pending}: {proc.stderr[-500:]}")
    return outcomes


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    folder = tmp_path_factory.mktemp("damage")
    model = souffle_py.optimize(build_model("mmoe", tiny=True), quiet=True)
    feeds = model.random_feeds()
    path = folder / "model.tar"
    model.export(path)
    np.savez(folder / "feeds.npz", **feeds)
    return path, folder, _digest(model.run(feeds))


def test_every_damaged_export_is_an_error_or_exact(export, tmp_path):
    path, folder, expected = export
    files = _cases(path, tmp_path)
    assert len(files) > 100
    outcomes = _run_children(str(folder / "feeds.npz"), files)
    bad = {case: line for case, line in outcomes.items()
           if not (line.startswith("ERROR ExportError") or line == f"OK {expected}")}
    assert not bad, json.dumps(bad, indent=1)
    # the damage is detected, not merely survived: most cases must be refused
    refused = sum(line.startswith("ERROR") for line in outcomes.values())
    assert refused >= len(outcomes) * 0.8, outcomes


def test_the_undamaged_export_runs_exactly(export):
    path, folder, expected = export
    assert _run_children(str(folder / "feeds.npz"), {"intact": str(path)})["intact"] == f"OK {expected}"


def test_damage_is_named(export, tmp_path):
    path, _, _ = export
    damaged = tmp_path / "params.tar"
    damaged.write_bytes(_rebuilt(path, "params.npz", lambda d: _flipped(d, len(d) // 2)))
    with pytest.raises(ExportError, match="member params.npz does not match its SHA-256"):
        souffle_py.load(damaged)
    plan = tmp_path / "plan.tar"
    plan.write_bytes(_rebuilt(path, PLAN, lambda d: d.replace(b'"device"', b'"devicf"')))
    with pytest.raises(ExportError, match=f"member {PLAN} does not match its SHA-256"):
        souffle_py.load(plan)


def _with_plan_edit(path, folder, field: str, value):
    """The export at `path` with plan.json's `field` set to `value` and plan.sha256 made to match: the
    file of another souffle-py, undamaged."""
    plan = json.loads(tarfile.open(path).extractfile(PLAN).read())
    plan[field] = value
    text = json.dumps(plan).encode()
    first = folder / "plan_only.tar"
    first.write_bytes(_rebuilt(path, PLAN, lambda d: text))
    edited = folder / f"{field}.tar"
    edited.write_bytes(_rebuilt(first, PLAN_SHA, lambda d: hashlib.sha256(text).hexdigest().encode()))
    return edited


def test_another_plan_version_is_named(export, tmp_path):
    with pytest.raises(ExportError, match="plan version 999: this souffle-py reads version 2"):
        souffle_py.load(_with_plan_edit(export[0], tmp_path, "version", 999))


def test_a_library_for_a_cpu_extension_this_machine_lacks_is_refused(tmp_path, monkeypatch):
    """A CPU without AVX-512 (this machine's /proc/cpuinfo with every avx512 flag removed): a model built
    here refuses to run and its export to load, naming the extensions, instead of dying of SIGILL."""
    from souffle_py import cpu_features

    if cpu_features.host_arch() != "x86_64" or "avx512f" not in (cpu_features.host_features() or ()):
        pytest.skip("needs an AVX-512 host")
    model = souffle_py.optimize(build_model("mmoe", tiny=True), quiet=True)
    assert "avx512f" in model.plan.cpu_features
    model.export(tmp_path / "avx512.tar")
    lines = open(cpu_features.CPUINFO).read().splitlines()
    without = [" ".join(w for w in line.split() if not w.startswith("avx512")) if line.startswith("flags") else line
               for line in lines]
    (tmp_path / "cpuinfo").write_text("\n".join(without) + "\n")
    monkeypatch.setattr(cpu_features, "CPUINFO", str(tmp_path / "cpuinfo"))
    with pytest.raises(TargetError, match="built for CPUs with .*avx512f"):
        souffle_py.load(tmp_path / "avx512.tar")
    with pytest.raises(TargetError, match="avx512f"):
        model.run(model.random_feeds())


def test_a_library_for_another_architecture_is_refused(export, tmp_path):
    with pytest.raises(TargetError, match="built for aarch64 CPUs"):
        souffle_py.load(_with_plan_edit(export[0], tmp_path, "arch", "aarch64"))
