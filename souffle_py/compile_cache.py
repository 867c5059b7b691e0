"""The compile cache: a compiled model stored as its export, found again by what made it.

`optimize()` keys a compile by the model's bytes, the input shapes, every option, the target (with the
CPU features its library may use) and souffle-py's code hash (code_version.py); a hit loads the stored
export (export.py: every member checked against its SHA-256) instead of compiling. Entries live in
`$SOUFFLE_CACHE/models` (default `.souffle_cache/models`), at most `$SOUFFLE_CACHE_SIZE` bytes in all
(default 4G; K, M, G suffixes), least recently used first out. An entry is written to a temporary file and
renamed into place, so two processes compiling one model at once leave one whole entry, never a torn one.
`optimize(cache=False)` or `SOUFFLE_COMPILE_CACHE=0` compiles without it; `souffle cache ls|clear`.

Weights are stored once, whatever the entries using them (a DynamicModel stores one entry per input shape:
BERT-base's 39 shapes held its 0.43 GB of weights 39 times): an entry's tar is the export without params.npz
and with weights.json instead, param name -> the SHA-256 of a blob `models/weights/<sha256>.npy`
(weight_store.py: one .npy per array, written before the entry is renamed into place, verified at its first
read). The cache's size is the entries' tars plus the blobs once each; eviction drops the least recently
used entries until the rest and the blobs they reference fit, then removes the blobs no entry references
that are older than GRACE_SECONDS (younger ones may belong to an entry another process is writing). A
missing or damaged blob makes its entry unusable: discarded and compiled again, like a damaged entry.

A hit in a new process must not cost more than the load itself (issue: under 1 s for BERT-base), so:
- an alias maps what optimize() was called with (the model's digest, the arguments as given, this host's
  CPU, the environment and the code) to the entry's key, and is answered before the compiler is imported
  (the key itself needs the resolved target and the pass list, i.e. TVM: 2+ s);
- a model file's digest is remembered with its stat (size, mtime, ctime, inode), as git's index does, and
  so is an entry's verification: an entry is written once and renamed into place, and while its file is
  unchanged its members' SHA-256 are not recomputed (a file that changes is verified again). Use marks the
  entry's .json, not the export, so reading an entry leaves its file as verified.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tarfile
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from souffle_py import weight_store
from souffle_py.atomic_files import read_text, settled_files, stamp, write_atomically
from souffle_py.code_version import code_hash
from souffle_py.errors import ExportError, InputError, SouffleError
from souffle_py.export import WEIGHT_REFS, model_from_members, model_members, read_members, write_members

log = logging.getLogger("souffle_py")

ENABLE_ENV, SIZE_ENV = "SOUFFLE_COMPILE_CACHE", "SOUFFLE_CACHE_SIZE"
DEFAULT_SIZE = 4 << 30
SUFFIX = ".tar"
VERIFIED = ".verified"   # the stat of the entry's file when its members' hashes were last checked
# An unreferenced weight blob younger than this is kept: a concurrent process may have just written (or
# touched) it for an entry it has not renamed into place yet. Writing an entry takes seconds, not minutes.
GRACE_SECONDS = 600


def enabled(cache: bool | None) -> bool:
    """`cache` when given, else on unless SOUFFLE_COMPILE_CACHE=0."""
    if cache is not None:
        if not isinstance(cache, bool):
            raise InputError(f"cache must be True, False or None, got {cache!r}")
        return cache
    return os.environ.get(ENABLE_ENV, "1") not in ("0", "", "false", "no")


def folder() -> Path:
    return Path(os.environ.get("SOUFFLE_CACHE", ".souffle_cache")) / "models"


def weights_folder() -> Path:
    """The entries' weight blobs, each stored once (weight_store.py)."""
    return folder() / "weights"


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


def model_digest(model) -> str:
    """SHA-256 of `model_bytes(model)`; for a file, remembered with its stat and recomputed when it changes."""
    if not isinstance(model, (str, os.PathLike)):
        return hashlib.sha256(model_bytes(model)).hexdigest()
    path = Path(model)
    try:
        before = stamp(path)
    except OSError:
        return hashlib.sha256(b"").hexdigest()  # the loader names the problem
    memo = folder().parent / "digests" / hashlib.sha1(str(path.resolve()).encode()).hexdigest()
    known = (read_text(memo) or "").split()
    if len(known) == 2 and known[0] == before:
        return known[1]
    digest = hashlib.sha256(model_bytes(model)).hexdigest()
    try:
        if stamp(path) == before:  # not rewritten while it was read
            write_atomically(memo, f"{before} {digest}")
    except OSError:
        pass
    return digest


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
    digest = hashlib.sha256(model_digest(model).encode())
    digest.update(json.dumps(options, sort_keys=True, default=str).encode())
    digest.update(target_description.encode())
    digest.update(code_hash().encode())
    return digest.hexdigest()[:40]


def lookup(entry_key: str) -> Path | None:
    """The stored export of `entry_key`, marked as just used (its .json); None on a miss."""
    path = folder() / f"{entry_key}{SUFFIX}"
    if not path.exists():
        return None
    try:
        path.with_suffix(".json").touch()
    except OSError:
        pass
    return path


def load_entry(entry_key: str, start: float):
    """The CompiledModel stored as `entry_key`, or None (a miss, or an entry that fails its checks:
    discarded). Its members' hashes are checked unless its file is the one verified before; its weights'
    blobs likewise (weight_store.py)."""
    from souffle_py.runtime import compiled_from

    path = lookup(entry_key)
    if path is None:
        return None
    verified = folder() / f"{entry_key}{VERIFIED}"
    try:
        current = stamp(path)
        trusted = read_text(verified) == current
        model = compiled_from(read_entry(path, verify=not trusted))
        if not trusted:
            write_atomically(verified, current)
    except (SouffleError, OSError) as exc:
        log.warning("compile cache: entry %s is unusable (%s); compiling again", entry_key[:12], exc)
        discard(entry_key)
        return None
    model.cached = True
    model.compile_seconds = time.perf_counter() - start
    log.info("compile cache: loaded %s in %.2fs", path, model.compile_seconds)
    return model


def read_entry(path: Path, verify: bool = True):
    """An entry's checked parts (export.ExportedModel) with its weights read from their blobs. The CPU is not
    checked: a model compiled for another machine is cached too, and its run() refuses it."""
    members = read_members(path)
    if WEIGHT_REFS not in members:  # entries of another code hash (another format) are never looked up
        raise ExportError(f"{path} is not a compile-cache entry: it lacks {WEIGHT_REFS}")
    exported = model_from_members(path, members, check_cpu=False, params={}, verify=verify)
    params = weight_store.load_arrays(weights_folder(), members[WEIGHT_REFS], path)
    missing = [spec.name for spec in exported.plan.buffers if spec.role == "param" and spec.name not in params]
    if missing:
        raise ExportError(f"{path}: {WEIGHT_REFS} lacks the weights {', '.join(missing[:5])}")
    return dataclasses.replace(exported, params=params)


def write_entry(model, path) -> None:
    """Write `model`'s weights as blobs (those not stored yet), then its export referring to them at `path`."""
    refs = weight_store.store_arrays(weights_folder(), model.params)
    write_members(path, model_members(model, params=False, extra={WEIGHT_REFS: refs}))


def alias_key(model, call: dict) -> str:
    """The alias of an optimize() call: the model's digest, its arguments as given, this host's CPU and
    environment, the tuning records' state and the code (whatever the entry's key is computed from)."""
    digest = hashlib.sha256(model_digest(model).encode())
    digest.update(json.dumps(call, sort_keys=True, default=str).encode())
    digest.update(_host_signature().encode())
    digest.update(_records_stamp(call.get("database")).encode())
    digest.update(code_hash().encode())
    return digest.hexdigest()[:40]


def resolve(alias: str) -> str | None:
    """The entry key an alias was last seen to compile to."""
    text = read_text(folder() / "aliases" / alias)
    return text.strip() if text else None


def remember(alias: str, entry_key: str) -> None:
    try:
        write_atomically(folder() / "aliases" / alias, entry_key)
    except OSError as exc:
        log.info("compile cache: could not write alias %s (%s)", alias[:12], exc)


def _host_signature() -> str:
    """What a default target resolves from: the CPU's identity and features, the cores this process may
    use, and the variables that steer souffle-py and TVM."""
    lines = []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features", "CPU part", "CPU implementer")):
                    lines.append(line.strip())
                if not line.strip() and lines:
                    break  # the first processor's block
    except OSError:
        pass
    import platform

    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith(("SOUFFLE_", "TVM_")))
    return json.dumps([platform.machine(), lines, os.cpu_count(), affinity, env])


def _records_stamp(database) -> str:
    """Sizes and times of the tuning records under the database folder (tuning more changes the key)."""
    from souffle_py.schedule.records import default_database_dir

    root = Path(database) if database else default_database_dir()
    stamps = []
    for path in sorted(root.glob("*/database_tuning_record.json")):
        try:
            stamps.append(f"{path.parent.name}:{stamp(path)}")
        except OSError:
            continue
    return ";".join(stamps)


def discard(entry_key: str) -> None:
    for name in (f"{entry_key}{SUFFIX}", f"{entry_key}.json", f"{entry_key}{VERIFIED}"):
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
        for suffix, write in ((SUFFIX, lambda p: write_entry(model, p)),
                              (".json", lambda p: Path(p).write_text(json.dumps(about, indent=1)))):
            handle, temporary = tempfile.mkstemp(dir=where, prefix=f".{entry_key}.", suffix=suffix)
            os.close(handle)
            try:
                write(temporary)
                os.replace(temporary, where / f"{entry_key}{suffix}")
            finally:
                if os.path.exists(temporary):
                    os.unlink(temporary)
        write_atomically(where / f"{entry_key}{VERIFIED}", stamp(where / f"{entry_key}{SUFFIX}"))
    except (OSError, SouffleError) as exc:
        log.warning("compile cache: could not store the compiled model in %s (%s)", where, exc)
        return
    evict(size_limit())


@dataclass(frozen=True)
class Entry:
    key: str
    path: Path
    bytes: int                # the entry's own file
    last_used: float
    about: dict
    weights: frozenset = frozenset()  # the SHA-256 of the weight blobs it refers to


def _weight_digests(path: Path) -> frozenset:
    """The blobs an entry refers to (weights.json is its first member); none when it cannot be read."""
    try:
        with tarfile.open(path, "r") as archive:
            for member in archive:
                if member.name == WEIGHT_REFS:
                    refs = weight_store.manifest_digests(archive.extractfile(member).read(), path)
                    return frozenset(about["sha256"] for about in refs.values())
    except (OSError, tarfile.TarError, EOFError, SouffleError):
        pass
    return frozenset()


def entries() -> list[Entry]:
    """Every entry, most recently used first."""
    found = []
    for path, stat in settled_files(folder(), SUFFIX):
        try:
            about = json.loads(path.with_suffix(".json").read_text())
            used = path.with_suffix(".json").stat().st_mtime
        except (OSError, ValueError):
            about, used = {}, stat.st_mtime
        found.append(Entry(path.stem, path, stat.st_size, used, about, _weight_digests(path)))
    return sorted(found, key=lambda e: -e.last_used)


def blob_sizes() -> dict[str, int]:
    """SHA-256 -> bytes of every weight blob."""
    return {digest: size for digest, (size, _) in weight_store.blobs(weights_folder()).items()}


def evict(limit: int) -> list[str]:
    """Remove the least recently used entries until the rest and the blobs they refer to (each counted once)
    fit `limit` bytes, then the blobs no entry refers to (older than GRACE_SECONDS); the removed keys."""
    sizes, kept, counted, removed = blob_sizes(), 0, set(), []
    for entry in entries():
        new = entry.weights - counted
        cost = entry.bytes + sum(sizes.get(digest, 0) for digest in new)
        if removed or kept + cost > limit:  # least recently used first out: every older entry goes too
            discard(entry.key)
            removed.append(entry.key)
        else:
            kept += cost
            counted |= new
    referenced = set().union(*(e.weights for e in entries()))  # entries renamed into place meanwhile count too
    freed = weight_store.collect_garbage(weights_folder(), referenced, time.time() - GRACE_SECONDS)
    if removed or freed:
        log.info("compile cache: evicted %d entries and %d bytes of unused weights (limit %d bytes)",
                 len(removed), freed, limit)
    return removed


def clear() -> int:
    """Remove every entry and every weight blob; how many entries there were."""
    all_entries = entries()
    for entry in all_entries:
        discard(entry.key)
    weight_store.remove_all(weights_folder())
    return len(all_entries)


def describe_entries() -> str:
    """`souffle cache ls`: one line per entry (its own file and its weights), most recently used first, and
    the total: the bytes on disk (entries, and blobs once each) and how many blobs several entries share."""
    all_entries, sizes = entries(), blob_sizes()
    own, weights = sum(e.bytes for e in all_entries), sum(sizes.values())
    shared = sum(1 for uses in Counter(d for e in all_entries for d in e.weights).values() if uses > 1)
    lines = [f"{len(all_entries)} compiled models in {folder()} ({(own + weights) / 2**20:.1f} MiB on disk of "
             f"{size_limit() / 2**20:.0f} MiB: {own / 2**20:.1f} MiB of entries and {weights / 2**20:.1f} MiB of "
             f"weights in {len(sizes)} blobs, {shared} of them shared by several entries)"]
    for e in all_entries:
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(e.last_used))
        mine = sum(sizes.get(digest, 0) for digest in e.weights)
        lines.append(f"  {e.key[:12]}  {e.bytes / 2**20:8.1f} MiB + weights {mine / 2**20:8.1f} MiB  used {used}  "
                     f"{e.about.get('model', '?')}  {e.about.get('target', '?')}  compiled in "
                     f"{e.about.get('compile_seconds', 0):.1f} s")
    return "\n".join(lines)
