"""Small files that concurrent processes share (the compile cache's entries, aliases and weight blobs): a
file is written to a temporary name and renamed into place, so a reader sees the old file or the new one,
never a torn one; a file's stat stamp says whether it changed since it was last verified."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def stamp(path: Path) -> str:
    """A file's stat as one string (size, mtime, ctime, inode): any rewrite changes it."""
    stat = path.stat()
    return f"{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ctime_ns}:{stat.st_ino}"


def write_atomically(path: Path, data: str | bytes) -> None:
    """Write `data` to `path` through a temporary file in its folder renamed into place (OSError raised)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(handle, "wb" if isinstance(data, (bytes, bytearray, memoryview)) else "w") as f:
            f.write(data)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def read_text(path: Path) -> str | None:
    """The file's text, or None where it cannot be read."""
    try:
        return path.read_text()
    except OSError:
        return None


def settled_files(folder: Path, suffix: str):
    """(path, stat) of each file in `folder` ending in `suffix`, except those being written (their temporary
    names start with a dot) and those removed while listed."""
    for path in folder.glob(f"*{suffix}"):
        if path.name.startswith("."):
            continue
        try:
            yield path, path.stat()
        except OSError:
            continue
