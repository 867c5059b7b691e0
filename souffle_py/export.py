"""Export a compiled model as one file and load it back, on a machine that only has TVM's runtime.

The file is a tar archive (no pickle anywhere):
  plan.json      the execution plan: buffers, kernel table, launches (souffle_py/plan.py)
  params.npz     the weights, as numpy arrays (loaded with allow_pickle=False)
  kernels.so     the built library (TVM's export_library: host code, and on CUDA the device module)
  device.bin     CUDA only: the nvcc-compiled device binary (fatbin) of that module's source
  device.cu      CUDA only: that source, for device_source() and inspection
Compile on a CPU machine with nvcc, run on the GPU machine: loading registers device.bin as the binary of
its source, so the GPU machine needs no CUDA compiler.

This module knows the file and nothing of CompiledModel (runtime.py builds the model from `read_model`),
so runtime.py imports it and not the other way round.
"""

from __future__ import annotations

import io
import os
import tarfile
import tempfile
from dataclasses import dataclass
from typing import Callable

import numpy as np

from souffle_py.errors import ExportError
from souffle_py.plan import ExecutionPlan

LIBRARY, PLAN, PARAMS, BINARY, SOURCE = "kernels.so", "plan.json", "params.npz", "device.bin", "device.cu"


@dataclass(frozen=True)
class ExportedModel:
    """What an exported file holds; `load_library` loads the built library on first use, and the extracted
    library lives as long as `keep_alive`."""

    plan: ExecutionPlan
    params: dict
    load_library: Callable
    device_source: str
    device_binary: bytes
    keep_alive: object


def export_model(model, path) -> None:
    """Write a CompiledModel (its plan, params, library(), device_binary(), device_source()) to `path`."""
    with tempfile.TemporaryDirectory(prefix="souffle-export-") as folder:
        library = os.path.join(folder, LIBRARY)
        try:
            model.library().export_library(library)
        except Exception as exc:
            raise ExportError(f"TVM could not export the built library: {str(exc).strip().splitlines()[-1]}") from exc
        params = io.BytesIO()
        np.savez(params, **model.params)
        members = {PLAN: model.plan.to_json().encode(), PARAMS: params.getvalue()}
        if model.plan.device == "cuda":
            members[BINARY] = model.device_binary()
            members[SOURCE] = model.device_source().encode()
        with open(library, "rb") as f:
            members[LIBRARY] = f.read()
        try:
            with tarfile.open(path, "w") as archive:
                for name, data in members.items():
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    archive.addfile(info, io.BytesIO(data))
        except OSError as exc:
            raise ExportError(f"cannot write {path}: {exc}") from exc


def read_model(path) -> ExportedModel:
    """The parts of a model written by CompiledModel.export (or `souffle compile -o`)."""
    try:
        with tarfile.open(path, "r") as archive:
            members = {m.name: archive.extractfile(m).read() for m in archive.getmembers() if m.isfile()}
    except (OSError, tarfile.TarError) as exc:
        raise ExportError(f"cannot read {path} as an exported souffle-py model: {exc}") from exc
    missing = [name for name in (PLAN, PARAMS, LIBRARY) if name not in members]
    if missing:
        raise ExportError(f"{path} is not an exported souffle-py model: it lacks {', '.join(missing)}")
    try:
        plan = ExecutionPlan.from_json(members[PLAN].decode())
    except (ValueError, KeyError, TypeError) as exc:
        raise ExportError(f"{path}: unreadable plan.json ({exc})") from exc
    with np.load(io.BytesIO(members[PARAMS]), allow_pickle=False) as archive:
        params = {name: archive[name] for name in archive.files}
    binary, source = members.get(BINARY, b""), members.get(SOURCE, b"").decode()
    if plan.device == "cuda" and not binary:
        raise ExportError(f"{path}: a CUDA model without its device binary ({BINARY})")
    folder = tempfile.TemporaryDirectory(prefix="souffle-load-")
    library = os.path.join(folder.name, LIBRARY)
    with open(library, "wb") as f:
        f.write(members[LIBRARY])

    def load_library():
        import tvm

        if binary:
            from souffle_py.backends.cuda.nvcc import register_binary

            register_binary(plan.device_binary, binary)
        try:
            return tvm.runtime.load_module(library)
        except Exception as exc:
            raise ExportError(f"TVM's runtime cannot load the library of {path}: "
                              f"{str(exc).strip().splitlines()[-1]}") from exc

    return ExportedModel(plan, params, load_library, source, binary, folder)
