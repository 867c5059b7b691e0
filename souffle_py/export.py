"""Export a compiled model as one file and load it back, on a machine that only has TVM's runtime.

The file is a tar archive (no pickle anywhere):
  plan.json      the execution plan: buffers, kernel table, launches (souffle_py/plan.py)
  params.npz     the weights, as numpy arrays (loaded with allow_pickle=False)
  kernels.so     the built library (TVM's export_library: host code, and on CUDA the device module)
  device.bin     CUDA only: the nvcc-compiled device binary (fatbin) of that module's source
  device.cu      CUDA only: that source, for device_source() and inspection
Compile on a CPU machine with nvcc, run on the GPU machine: loading registers device.bin as the binary of
its source, so the GPU machine needs no CUDA compiler.
"""

from __future__ import annotations

import io
import os
import tarfile
import tempfile

import numpy as np

from souffle_py.errors import ExportError
from souffle_py.plan import ExecutionPlan
from souffle_py.runtime import CompiledModel

LIBRARY, PLAN, PARAMS, BINARY, SOURCE = "kernels.so", "plan.json", "params.npz", "device.bin", "device.cu"


def export_model(model: CompiledModel, path) -> None:
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


def load(path) -> CompiledModel:
    """A CompiledModel from a file written by CompiledModel.export (or `souffle compile -o`). A CUDA model
    loads anywhere (describe, device_source); running it needs a GPU."""
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

    model = CompiledModel(plan, load_library, params, device_source=source, device_binary=binary)
    model._keep_alive = folder  # the extracted library lives as long as the model
    return model
