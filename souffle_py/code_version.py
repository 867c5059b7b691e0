"""One hash of the code that makes a compiled model: souffle-py's own sources and the versions of the
libraries that take part in compiling (TVM, its FFI, onnx, numpy).

Whatever is stored from a compile (a cached model, tuning records, measured schedule variants) is keyed by
it, so that a changed rule never replays what an older one chose.
"""

from __future__ import annotations

import functools
import hashlib
from importlib import metadata
from pathlib import Path

PACKAGES = ("souffle_py", "te_passes")
LIBRARIES = ("apache-tvm", "apache-tvm-ffi", "onnx", "numpy")


@functools.cache
def code_hash() -> str:
    """SHA-256 (hex) of every .py file of souffle-py's packages, by path, and the libraries' versions."""
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parent.parent
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    for library in LIBRARIES:
        try:
            version = metadata.version(library)
        except metadata.PackageNotFoundError:
            version = "absent"
        digest.update(f"{library}=={version}\0".encode())
    return digest.hexdigest()
