"""Export a compiled model as one file and load it back, on a machine that only has TVM's runtime.

The file is a tar archive (no pickle anywhere):
  plan.json      the execution plan: buffers, kernel table, launches (souffle_py/plan.py), the CPU the
                 library was built for (architecture and instruction-set extensions) and the SHA-256 of
                 every other member
  plan.sha256    the SHA-256 of plan.json
  params.npz     the weights, as numpy arrays (loaded with allow_pickle=False); a compile-cache entry has
                 weights.json instead, naming blobs stored once for all entries (weight_store.py)
  kernels.so     the built library (TVM's export_library: host code, and on CUDA the device module)
  device.bin     CUDA only: the nvcc-compiled device binary (fatbin) of that module's source
  device.cu      CUDA only: that source, for device_source() and inspection
Compile on a CPU machine with nvcc, run on the GPU machine: loading registers device.bin as the binary of
its source, so the GPU machine needs no CUDA compiler.

Loading checks the file before anything of it runs: every member against its SHA-256 (a damaged or
truncated member is an ExportError naming it, never a crash in the dynamic loader or a silent wrong
answer) and, for a CPU library, this CPU against the one it was built for (TargetError naming the missing
extensions, never SIGILL).

This module knows the file and nothing of CompiledModel (runtime.py builds the model from `read_model`),
so runtime.py imports it and not the other way round.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import os
import struct
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from typing import Callable

import numpy as np

from souffle_py.cpu_features import check_runnable
from souffle_py.cross_link import library_compiler
from souffle_py.errors import ExportError
from souffle_py.plan import ExecutionPlan, PlanVersionError

LIBRARY, PLAN, PARAMS, BINARY, SOURCE = "kernels.so", "plan.json", "params.npz", "device.bin", "device.cu"
PLAN_SHA = "plan.sha256"
DYNAMIC = "dynamic.json"  # the manifest of a dynamic model's export (dynamic.py)
WEIGHT_REFS = "weights.json"  # a compile-cache entry's weights by reference, instead of params.npz (weight_store.py)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


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
    write_members(path, model_members(model))


def model_members(model, params: bool = True, extra: dict[str, bytes] | None = None) -> dict[str, bytes]:
    """The members of a CompiledModel's export, plan.json (listing the others' SHA-256) and plan.sha256
    included; params=False leaves the weights out (a dynamic model's export stores them once for all its
    shapes, dynamic.py; a compile-cache entry refers to its weights' blobs, weight_store.py), and `extra`
    members (name -> bytes) are added and listed with the others."""
    fcompile = library_compiler(model.plan.arch) if model.plan.device == "cpu" else None  # another CPU's linker
    with tempfile.TemporaryDirectory(prefix="souffle-export-") as folder:
        library = os.path.join(folder, LIBRARY)
        try:
            model.library().export_library(library, **({"fcompile": fcompile} if fcompile else {}))
        except Exception as exc:
            raise ExportError(f"TVM could not export the built library: {str(exc).strip().splitlines()[-1]}") from exc
        members = dict(extra or {})
        if params:
            buffer = io.BytesIO()
            np.savez(buffer, **model.params)
            members[PARAMS] = buffer.getvalue()
        if model.plan.device == "cuda":
            members[BINARY] = model.device_binary()
            members[SOURCE] = model.device_source().encode()
        with open(library, "rb") as f:
            members[LIBRARY] = f.read()
    plan = dataclasses.replace(model.plan, member_sha256=tuple((n, sha256(d)) for n, d in members.items()))
    members[PLAN] = plan.to_json().encode()
    members[PLAN_SHA] = sha256(members[PLAN]).encode()
    return members


def write_members(path, members: dict[str, bytes]) -> None:
    """A tar archive of `members` (name -> bytes) at `path`."""
    try:
        with tarfile.open(path, "w") as archive:
            for name, data in members.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
    except OSError as exc:
        raise ExportError(f"cannot write {path}: {exc}") from exc


def read_members(path) -> dict[str, bytes]:
    """The members of an exported file, name -> bytes (unchecked)."""
    try:
        with tarfile.open(path, "r") as archive:
            return {m.name: archive.extractfile(m).read() for m in archive.getmembers() if m.isfile()}
    except (OSError, tarfile.TarError, EOFError, ValueError) as exc:
        raise ExportError(f"cannot read {path} as an exported souffle-py model: {exc}") from exc


def read_model(path, check_cpu: bool = True, verify: bool = True) -> ExportedModel:
    """The parts of a model written by CompiledModel.export (or `souffle compile -o`), each checked against
    its SHA-256, and (check_cpu) the library's CPU against this one's, before any of it is loaded. The
    compile cache reads a model compiled for another machine without the CPU check: run() checks it; and
    an entry whose file is unchanged since it was verified without the members' hashes (verify=False; the
    plan's own is always checked)."""
    members = read_members(path)
    if DYNAMIC in members:
        raise ExportError(f"{path} holds a model with dynamic dimensions (several shapes): load it with "
                          "souffle_py.load()")
    return model_from_members(path, members, check_cpu, verify=verify)


def model_from_members(path, members: dict[str, bytes], check_cpu: bool = True,
                       params: dict | None = None, verify: bool = True) -> ExportedModel:
    """One model's parts from its members (read_model), checked; `params` given: the weights come from the
    caller (a dynamic model's shared store), not from a params.npz member."""
    missing = [name for name in (PLAN, LIBRARY) + ((PARAMS,) if params is None else ()) if name not in members]
    if missing == [PARAMS] and WEIGHT_REFS in members:
        raise ExportError(f"{path} is a compile-cache entry: its weights are stored apart (weight_store.py); "
                          "optimize() the model to load it, or export() a model to get a file for load()")
    if missing:
        raise ExportError(f"{path} is not an exported souffle-py model: it lacks {', '.join(missing)}")
    plan = _checked_plan(path, members)
    for name, digest in plan.member_sha256:
        if name not in members:
            raise ExportError(f"{path} is damaged: member {name} is missing")
        if verify and sha256(members[name]) != digest:
            raise ExportError(f"{path} is damaged: member {name} does not match its SHA-256 "
                              f"({len(members[name])} bytes)")
    plan = dataclasses.replace(plan, member_sha256=())  # the file's record, checked: the plan as compiled
    if plan.device == "cpu" and check_cpu:
        check_runnable(plan.arch, plan.cpu_features, f"the library of {path}")
    try:
        params = npz_arrays(members[PARAMS]) if params is None else params
    except Exception as exc:  # noqa: BLE001  (zipfile, numpy and tokenizer errors: one message)
        raise ExportError(f"{path}: unreadable {PARAMS} ({type(exc).__name__}: {exc})") from exc
    binary, source = members.get(BINARY, b""), members.get(SOURCE, b"").decode(errors="replace")
    if plan.device == "cuda" and not binary:
        raise ExportError(f"{path}: a CUDA model without its device binary ({BINARY})")
    folder = tempfile.TemporaryDirectory(prefix="souffle-load-")
    library = os.path.join(folder.name, LIBRARY)
    with open(library, "wb") as f:
        f.write(members[LIBRARY])

    def load_library():
        from souffle_py.memory import load_library as load

        if binary:
            from souffle_py.backends.cuda.nvcc import register_binary

            register_binary(plan.device_binary, binary)
        try:
            return load(library, plan.device)
        except Exception as exc:
            raise ExportError(f"TVM's runtime cannot load the library of {path}: "
                              f"{str(exc).strip().splitlines()[-1]}") from exc

    return ExportedModel(plan, params, load_library, source, binary, folder)


def npz_arrays(data: bytes) -> dict:
    """The arrays of an uncompressed .npz (np.savez's) as read-only views of `data`: np.load copies each
    through zipfile (1.2 s for BERT-base's 440 MB of weights, most of a load from the compile cache).
    Another layout (compressed members) goes through np.load; never pickles."""
    arrays = {}
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        infos = archive.infolist()
        if any(info.compress_type != zipfile.ZIP_STORED for info in infos):
            with np.load(io.BytesIO(data), allow_pickle=False) as npz:
                return {name: npz[name] for name in npz.files}
        for info in infos:
            name_length, extra_length = struct.unpack_from("<HH", data, info.header_offset + 26)
            start = info.header_offset + 30 + name_length + extra_length  # past the local file header
            arrays[info.filename.removesuffix(".npy")] = npy_view(data, start, info.filename)
    return arrays


def npy_view(data: bytes, start: int = 0, name: str = "array") -> np.ndarray:
    """The array of the .npy bytes at `data[start:]` as a read-only view of `data` (no copy, no pickle)."""
    header = io.BytesIO(data[start:start + (1 << 17)])
    version = np.lib.format.read_magic(header)
    read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, fortran_order, dtype = read_header(header)
    if dtype.hasobject:
        raise ValueError(f"{name}: object arrays are not weights")
    count = int(np.prod(shape, dtype=np.int64))
    array = np.frombuffer(data, dtype, count=count, offset=start + header.tell())
    return array.reshape(shape, order="F" if fortran_order else "C")


def _checked_plan(path, members) -> ExecutionPlan:
    """The plan of an export, checked against its recorded SHA-256 and parsed."""
    text = members[PLAN]
    if PLAN_SHA not in members:
        raise ExportError(f"{path} has no {PLAN_SHA}: it was written by an older souffle-py, or damaged (export "
                          "the model again with this version)")
    if members[PLAN_SHA].strip() != sha256(text).encode():
        raise ExportError(f"{path} is damaged: member {PLAN} does not match its SHA-256 ({PLAN_SHA})")
    try:
        return ExecutionPlan.from_json(text.decode())
    except PlanVersionError as exc:
        raise ExportError(f"{path}: {exc}") from None
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
        raise ExportError(f"{path}: unreadable {PLAN} ({type(exc).__name__}: {exc})") from exc
