"""The compile cache: a compiled model stored as its export, found again by what made it.

`optimize()` keys a compile by the model's bytes, the input shapes, every option, the target (with the
CPU features its library may use) and souffle-py's code hash (code_version.py); a hit loads the stored
export (export.py: every member checked against its SHA-256) instead of compiling. Entries live in
`$SOUFFLE_CACHE/models` (default `.souffle_cache/models`), at most `$SOUFFLE_CACHE_SIZE` bytes in all
(default 4G; K, M, G suffixes), least recently used first out. An entry is written to a temporary file and
renamed into place, so two processes compiling one model at once leave one whole entry, never a torn one.
`optimize(cache=False)` or `SOUFFLE_COMPILE_CACHE=0` compiles without it; `souffle cache ls|clear`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from souffle_py.code_version import code_hash
from souffle_py.errors import InputError, SouffleError

log = logging.getLogger("souffle_py")

ENABLE_ENV, SIZE_ENV = "SOUFFLE_COMPILE_CACHE", "SOUFFLE_CACHE_SIZE"
DEFAULT_SIZE = 4 << 30
SUFFIX = ".tar"


def enabled(cache: bool | None) -> bool:
    """`cache` when given, else on unless SOUFFLE_COMPILE_CACHE=0."""
    if cache is not None:
        if not isinstance(cache, bool):
            raise InputError(f"cache must be True, False or None, got {cache!r}")
        return cache
    return os.environ.get(ENABLE_ENV, "1") not in ("0", "", "false", "no")


def folder() -> Path:
    return Path(os.environ.get("SOUFFLE_CACHE", ".souffle_cache")) / "models"


def size_limit() -> int:
    """SOUFFLE_CACHE_SIZE in bytes (K, M, G suffixes), DEFAULT_SIZE when unset."""
    text = os.environ.get(SIZE_ENV, "").strip().upper()
    if not text:
        return DEFAULT_SIZE
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
    try:
        return int(float(text.rstrip("KMG")) * scale)
    except ValueError:
        raise InputError(f"{SIZE_ENV}={text!r}: expected a size in bytes, e.g. 4G or 500M") from None


def model_bytes(model) -> bytes:
    """The bytes that identify a model: a file's own, or a ModelProto serialized deterministically."""
    if isinstance(model, (str, os.PathLike)):
        try:
            return Path(model).read_bytes()
        except OSError:
            return b""  # the loader names the problem
    serialize = getattr(model, "SerializeToString", None)
    return serialize(deterministic=True) if serialize else b""


def key(model, options: dict, target_description: str) -> str:
    """The entry name of a compile: SHA-256 of the model's bytes, the options and target, and the code."""
    digest = hashlib.sha256(model_bytes(model))
    digest.update(json.dumps(options, sort_keys=True, default=str).encode())
    digest.update(target_description.encode())
    digest.update(code_hash().encode())
    return digest.hexdigest()[:40]


def lookup(entry_key: str) -> Path | None:
    """The stored export of `entry_key`, marked as just used; None on a miss."""
    path = folder() / f"{entry_key}{SUFFIX}"
    try:
        os.utime(path)
    except OSError:
        return None
    return path


def discard(entry_key: str) -> None:
    for name in (f"{entry_key}{SUFFIX}", f"{entry_key}.json"):
        try:
            (folder() / name).unlink()
        except OSError:
            pass


def store(model, entry_key: str, about: dict) -> None:
    """Export `model` as the entry `entry_key` (atomically), with `about` for `souffle cache ls`; then evict
    down to the size limit. A cache that cannot be written is skipped with a warning."""
    where = folder()
    try:
        where.mkdir(parents=True, exist_ok=True)
        for suffix, write in ((SUFFIX, model.export),
                              (".json", lambda p: Path(p).write_text(json.dumps(about, indent=1)))):
            handle, temporary = tempfile.mkstemp(dir=where, prefix=f".{entry_key}.", suffix=suffix)
            os.close(handle)
            try:
                write(temporary)
                os.replace(temporary, where / f"{entry_key}{suffix}")
            finally:
                if os.path.exists(temporary):
                    os.unlink(temporary)
    except (OSError, SouffleError) as exc:
        log.warning("compile cache: could not store the compiled model in %s (%s)", where, exc)
        return
    evict(size_limit())


@dataclass(frozen=True)
class Entry:
    key: str
    path: Path
    bytes: int
    last_used: float
    about: dict


def entries() -> list[Entry]:
    """Every entry, most recently used first."""
    found = []
    for path in folder().glob(f"*{SUFFIX}"):
        if path.name.startswith("."):
            continue  # being written
        try:
            stat = path.stat()
        except OSError:
            continue  # evicted meanwhile
        try:
            about = json.loads(path.with_suffix(".json").read_text())
        except (OSError, ValueError):
            about = {}
        found.append(Entry(path.stem, path, stat.st_size, stat.st_mtime, about))
    return sorted(found, key=lambda e: -e.last_used)


def evict(limit: int) -> list[str]:
    """Remove the least recently used entries until the rest fit `limit` bytes; their keys."""
    kept, removed = 0, []
    for entry in entries():
        kept += entry.bytes
        if kept > limit:
            discard(entry.key)
            removed.append(entry.key)
    if removed:
        log.info("compile cache: evicted %d entries (over %d bytes)", len(removed), limit)
    return removed


def clear() -> int:
    """Remove every entry; how many there were."""
    all_entries = entries()
    for entry in all_entries:
        discard(entry.key)
    return len(all_entries)


def describe_entries() -> str:
    """`souffle cache ls`: one line per entry, most recently used first, and the total."""
    all_entries = entries()
    lines = [f"{len(all_entries)} compiled models in {folder()} ({sum(e.bytes for e in all_entries) / 2**20:.1f} "
             f"MiB of {size_limit() / 2**20:.0f} MiB)"]
    for e in all_entries:
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(e.last_used))
        lines.append(f"  {e.key[:12]}  {e.bytes / 2**20:8.1f} MiB  used {used}  {e.about.get('model', '?')}  "
                     f"{e.about.get('target', '?')}  compiled in {e.about.get('compile_seconds', 0):.1f} s")
    return "\n".join(lines)
