"""Content-addressed weight blobs: the compile cache stores each weight once, whatever the entries using it.

A DynamicModel compiles one static model per input shape and the compile cache stores each as an entry;
with the weights inside every entry, BERT-base's 39 shapes held its 0.43 GB of weights 39 times. Instead an
entry's tar holds MANIFEST (param name -> blob digest, dtype and shape) and each array lives once in
`<folder>/<sha256 of the file>.npy` (np.save's bytes, written to a temporary file and renamed into place).

The file name is the SHA-256 of its bytes: a blob is hashed the first time it is read and its stat is then
remembered in `<digest>.verified` (as the entries' own .verified files), so a later load reads each file
once and hashes nothing. A missing, damaged or wrong-shaped blob is an ExportError naming the file (the
compile cache then discards the entry and compiles again); a damaged blob is removed. Within one process a
blob already loaded is the same read-only numpy array, so a DynamicModel's shapes share it for free.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import weakref
from pathlib import Path

import numpy as np

from souffle_py.atomic_files import read_text, settled_files, stamp, write_atomically
from souffle_py.errors import ExportError
from souffle_py.export import WEIGHT_REFS, npy_view

MANIFEST = WEIGHT_REFS  # the member of a compile-cache entry that replaces params.npz
SUFFIX, VERIFIED = ".npy", ".verified"
FORMAT = 1

_loaded: "weakref.WeakValueDictionary[str, np.ndarray]" = weakref.WeakValueDictionary()
_loaded_stamps: dict[str, str] = {}  # digest -> the blob file's stat when this process loaded it


def blob_path(folder: Path, digest: str) -> Path:
    return folder / f"{digest}{SUFFIX}"


def store_arrays(folder: Path, params: dict) -> bytes:
    """Write each array of `params` as a blob (unless one with its bytes exists: then it is touched, so the
    garbage collection's grace period protects it until the entry is in place); the MANIFEST member."""
    folder.mkdir(parents=True, exist_ok=True)
    weights = {}
    for name, values in params.items():
        values = np.asarray(values)
        buffer = io.BytesIO()
        np.save(buffer, values, allow_pickle=False)
        data = buffer.getbuffer()
        digest = hashlib.sha256(data).hexdigest()
        path = blob_path(folder, digest)
        if not _touch(path):
            _write_blob(path, data)
        weights[name] = {"sha256": digest, "dtype": values.dtype.str, "shape": list(values.shape)}
    return json.dumps({"format": FORMAT, "weights": weights}, indent=0, sort_keys=True).encode()


def manifest_digests(manifest: bytes, where) -> dict[str, dict]:
    """Param name -> {sha256, dtype, shape} of a MANIFEST member (`where` names the entry in errors)."""
    try:
        text = json.loads(manifest)
        if text.get("format") != FORMAT:
            raise ValueError(f"format {text.get('format')!r}, expected {FORMAT}")
        weights = text["weights"]
        for name, about in weights.items():
            digest = about.get("sha256")
            if not isinstance(digest, str) or len(digest) != 64 or digest.strip("0123456789abcdef"):
                raise ValueError(f"{name}: no SHA-256")
        return weights
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ExportError(f"{where}: unreadable {MANIFEST} ({type(exc).__name__}: {exc})") from exc


def load_arrays(folder: Path, manifest: bytes, where) -> dict:
    """The weights a MANIFEST member names, read from their blobs (each checked against its SHA-256 unless its
    file is the one verified before) and checked against the recorded dtype and shape."""
    params = {}
    for name, about in manifest_digests(manifest, where).items():
        values = load_blob(folder, about["sha256"])
        if values.dtype.str != about.get("dtype") or list(values.shape) != list(about.get("shape", ())):
            raise ExportError(f"{where}: weight {name}: blob {blob_path(folder, about['sha256'])} holds "
                              f"{values.dtype.str}{list(values.shape)}, the entry expects "
                              f"{about.get('dtype')}{about.get('shape')}")
        params[name] = values
    return params


def load_blob(folder: Path, digest: str) -> np.ndarray:
    """One blob as a read-only array: the one this process loaded already while its file is unchanged."""
    path = blob_path(folder, digest)
    try:
        now = stamp(path)
    except OSError as exc:
        raise ExportError(f"weight blob {path} is missing ({exc.strerror or exc})") from None
    known = _loaded.get(digest)
    if known is not None and _loaded_stamps.get(digest) == now:
        return known
    try:
        data = path.read_bytes()
        trusted = read_text(path.with_suffix(VERIFIED)) == now
    except OSError as exc:
        raise ExportError(f"weight blob {path} cannot be read ({exc.strerror or exc})") from None
    if not trusted and hashlib.sha256(data).hexdigest() != digest:
        _remove(path)
        raise ExportError(f"weight blob {path} is damaged: its bytes do not match its SHA-256 (removed)")
    try:
        values = npy_view(data, 0)
    except Exception as exc:  # noqa: BLE001  (numpy's header errors: one message)
        _remove(path)
        raise ExportError(f"weight blob {path} is not a .npy array ({type(exc).__name__}: {exc}; removed)") from exc
    if not trusted:
        _write_stamp(path, now)
    _loaded[digest], _loaded_stamps[digest] = values, now
    return values


def forget() -> None:
    """Drop this process's memo of loaded blobs (tests: a load as in a new process)."""
    _loaded.clear()
    _loaded_stamps.clear()


def blobs(folder: Path) -> dict[str, tuple[int, float]]:
    """digest -> (bytes, mtime) of every blob in `folder`."""
    return {path.stem: (stat.st_size, stat.st_mtime) for path, stat in settled_files(folder, SUFFIX)}


def collect_garbage(folder: Path, referenced: set[str], older_than: float) -> int:
    """Remove the blobs no entry references whose mtime is before `older_than` (a blob written or touched
    since may belong to an entry a concurrent process is about to rename into place), leftover temporary
    files that old, and stamps without their blob; the bytes freed."""
    freed = 0
    for digest, (size, mtime) in blobs(folder).items():
        if digest not in referenced and mtime < older_than:
            freed += size
            _remove(blob_path(folder, digest))
    for path in _listing(folder):
        if not (path.name.startswith(".") or path.suffix == VERIFIED):
            continue
        try:
            stale = path.name.startswith(".") and path.stat().st_mtime < older_than
            if stale or (path.suffix == VERIFIED and not path.with_suffix(SUFFIX).exists()):
                path.unlink()
        except OSError:
            pass
    return freed


def remove_all(folder: Path) -> int:
    """Remove every blob, stamp and temporary file in `folder`; how many blobs there were."""
    count = len(blobs(folder))
    for path in _listing(folder):
        try:
            path.unlink()
        except OSError:
            pass
    return count


def _listing(folder: Path) -> list[Path]:
    try:
        return list(folder.iterdir())
    except OSError:
        return []


def _touch(path: Path) -> bool:
    """Mark an existing blob as just used, keeping its verification if the file was unchanged; False when
    there is no such blob."""
    try:
        before = stamp(path)
        verified = read_text(path.with_suffix(VERIFIED)) == before
        os.utime(path)
    except OSError:
        return False
    try:
        after = stamp(path)
    except OSError:
        return False  # removed meanwhile: written again
    if verified:
        _write_stamp(path, after)
    if _loaded_stamps.get(path.stem) == before:
        _loaded_stamps[path.stem] = after  # this process's array of it stays the one later loads return
    return True


def _write_blob(path: Path, data) -> None:
    write_atomically(path, data)
    _write_stamp(path, stamp(path))  # hashed just now: the next load reads it without hashing


def _write_stamp(path: Path, text: str) -> None:
    """Record `text` as the verified stat of blob `path`; best effort (unrecorded: hashed at its next load)."""
    try:
        write_atomically(path.with_suffix(VERIFIED), text)
    except OSError:
        pass


def _remove(path: Path) -> None:
    for stale in (path, path.with_suffix(VERIFIED)):
        try:
            stale.unlink()
        except OSError:
            pass
