"""The tuning database's files on disk, made whole again after an interrupted tune.

MetaSchedule's JSONDatabase appends one JSON line per workload and per measured candidate, as each is
measured, so a tune that is killed keeps every record measured before, but may leave its last line half
written, and TVM then refuses the whole file ("Unexpected EOF"). `repair` drops such a line (a workload
line is always written before the records that point at it, so no complete record loses its workload),
and ends a complete last line that lacks its newline, by writing the file anew and renaming it over the
old one: an interruption of the repair itself leaves the old file.

Two processes compiling at once both record variants into one folder. JSONDatabase numbers workloads by
their line in the workload file as its process last read it, so two writers appending at once made records
point at other workloads, and every later compile died opening the folder (TVM: "old_outputs.size() ==
new_outputs.size()"). `locked` serializes a folder's readers and writers across processes (flock); a writer
reads the folder again under the lock before it appends; a folder TVM still refuses is set aside
(`set_aside`) and started anew, with a warning naming it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import time
from pathlib import Path

from souffle_py.code_version import code_hash

FILES = ("database_workload.json", "database_tuning_record.json")


def default_database_dir() -> Path:
    """$SOUFFLE_CACHE/tuning, else .souffle_cache/tuning under the current directory."""
    return Path(os.environ.get("SOUFFLE_CACHE", ".souffle_cache")) / "tuning"


def database_path(database_dir: str | os.PathLike, target) -> Path:
    """The folder of `target`'s records under `database_dir`, named by the target's kind and a hash of the
    target and of souffle-py's code (code_version.py): records made by other rules are not replayed. Every
    caller passes a resolved Target (the backend's): tuning never resolves target names itself."""
    key = hashlib.sha1(f"{target}\0{code_hash()}".encode()).hexdigest()[:12]
    return Path(database_dir) / f"{target.kind.name}-{key}"


def records_fingerprint(database_dir: str | os.PathLike, target) -> str:
    """Size and time of `target`'s tuning records (the compile cache's key: tuning more makes a new key)."""
    path = database_path(database_dir, target) / FILES[1]
    try:
        stat = path.stat()
    except OSError:
        return "none"
    return f"{stat.st_size}:{stat.st_mtime_ns}"

log = logging.getLogger(__name__)


def repair(folder: str | os.PathLike) -> int:
    """Make the database files in `folder` loadable; returns the number of half-written lines dropped."""
    dropped = 0
    for name in FILES:
        path = Path(folder) / name
        if not path.exists():
            continue
        data = path.read_bytes()
        if not data or data.endswith(b"\n"):
            continue
        head, _, last = data.rpartition(b"\n")
        try:
            json.loads(last)
            fixed = data + b"\n"
        except ValueError:
            fixed = head + b"\n" if head else b""
            dropped += 1
            log.warning("%s: dropped a half-written last line (%d bytes) left by an interrupted tune", path, len(last))
        replace_atomically(path, fixed)
    return dropped


def replace_atomically(path: Path, data: bytes) -> None:
    """Write `data` to a file beside `path`, flush it to disk, and rename it over `path`."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(temporary, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


@contextlib.contextmanager
def locked(folder: str | os.PathLike):
    """An exclusive lock of the records folder `folder` across processes, held while the block runs."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def set_aside(folder: str | os.PathLike) -> Path:
    """Move the database files of `folder` into a subfolder `damaged-<time>` (kept for a bug report);
    returns it. The caller holds `locked(folder)`."""
    folder = Path(folder)
    aside = folder / f"damaged-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    aside.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        if (folder / name).exists():
            os.replace(folder / name, aside / name)
    return aside
