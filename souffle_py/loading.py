"""souffle_py.load(): a model from a file written by `export` (CompiledModel's, or a DynamicModel's with all
its shapes, dynamic.py). A dynamic model loaded where the compiler is installed compiles new shapes on first
use; elsewhere it runs the shapes the file holds."""

from __future__ import annotations

from souffle_py.dynamic import DynamicModel, load_dynamic
from souffle_py.errors import SouffleError
from souffle_py.export import DYNAMIC, model_from_members, read_members
from souffle_py.runtime import CompiledModel, compiled_from


def load(path, check_cpu: bool = True, verify: bool = True) -> "CompiledModel | DynamicModel":
    """The model of a file written by CompiledModel.export or DynamicModel.export (or `souffle compile -o`).
    A CUDA model loads anywhere (describe, device_source); running it needs a GPU. A CPU library built for a
    CPU this one cannot run is a TargetError here, unless check_cpu is False (run() still refuses); verify=False
    skips the members' SHA-256 (the compile cache, for an entry verified before)."""
    members = read_members(path)
    if DYNAMIC in members:
        return load_dynamic(path, members, _compile, check_cpu)
    return compiled_from(model_from_members(path, members, check_cpu, verify=verify))


def _compile(model, **options) -> CompiledModel:
    """optimize(), imported when a loaded dynamic model meets a new shape."""
    try:
        from souffle_py.api import optimize
    except ImportError as exc:
        raise SouffleError(f"this shape is not in the exported file and the compiler cannot be imported here "
                           f"({exc}); install souffle-py with its compiler dependencies") from exc
    return optimize(model, **options)
