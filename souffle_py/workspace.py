"""The buffers one inference writes, and the pool that gives each concurrent run() its own.

A Workspace holds a model's inputs, intermediates and outputs on the device, with every kernel call bound
to them; the weights are shared by all workspaces (kernels only read them). run() takes a workspace from
the pool for its whole duration and gives it back, so calls from many threads overlap instead of queueing
on a lock, and none reads another's intermediates. The pool grows to the highest number of calls that
were ever in flight at once and keeps those workspaces for reuse (each costs `Workspace.nbytes`).

On the CPU the inputs are copied into the workspace through numpy views of its buffers (no DLPack round
trip per call) and each output is returned as a fresh copy, never a view: a later call cannot overwrite an
array a caller holds.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from souffle_py.errors import InputError
from souffle_py.memory import itemsize


class Workspace:
    """One inference's device buffers and the kernel calls bound to them."""

    def __init__(self, plan, functions: dict, params: dict, memory):
        buffers = dict(params)
        for spec in plan.buffers:
            if spec.role != "param":
                buffers[spec.name] = memory.empty(spec.shape, spec.dtype)
        self.buffers = buffers
        self.calls = [(functions[call.function], [buffers[a] for a in call.args]) for call in plan.calls]
        self.nbytes = workspace_bytes(plan)
        # CPU: numpy views of the input and output buffers (zero-copy), for copies without an FFI call each
        self.input_views = [memory.view(buffers[b]) for _, b in plan.inputs]
        self.output_views = [memory.view(buffers[b]) for _, b in plan.outputs]
        self.input_buffers = [buffers[b] for _, b in plan.inputs]
        self.output_buffers = [buffers[b] for _, b in plan.outputs]

    def load(self, feeds: Mapping, specs) -> bool:
        """Copy `feeds` into the input buffers; False (nothing raised) where a feed is not exactly what the
        model declares, so that the caller can name the problem. `specs`: (name, shape, numpy dtype)."""
        for (name, shape, dtype), view, buffer in zip(specs, self.input_views, self.input_buffers):
            value = feeds.get(name)
            if type(value) is not np.ndarray or value.shape != shape or value.dtype != dtype:
                return False
            if view is not None:
                np.copyto(view, value)
            else:
                buffer.copyfrom(np.ascontiguousarray(value))
        return True

    def results(self, names, out: Mapping | None = None) -> dict:
        """The outputs by name: fresh arrays, or written into the caller's arrays `out` (name -> array of
        the output's shape and dtype, C-contiguous or not)."""
        if out is None:
            return {name: (view.copy() if view is not None else buffer.numpy())
                    for name, view, buffer in zip(names, self.output_views, self.output_buffers)}
        result = {}
        for name, view, buffer in zip(names, self.output_views, self.output_buffers):
            target = out.get(name)
            if target is None:
                result[name] = view.copy() if view is not None else buffer.numpy()
                continue
            source = view if view is not None else buffer.numpy()
            np.copyto(target, source)
            result[name] = target
        return result


def workspace_bytes(plan) -> int:
    """Bytes of one workspace: every buffer but the weights."""
    return sum(int(np.prod(s.shape, dtype=np.int64)) * itemsize(s.dtype)
               for s in plan.buffers if s.role != "param")


def check_out(out, names, buffers) -> None:
    """Refuse an `out=` argument that does not fit the model's outputs (`buffers`: their specs)."""
    if not isinstance(out, Mapping):
        raise InputError(f"out must be a dict of output name -> numpy array, got {type(out).__name__}")
    unknown = [n for n in out if n not in names]
    if unknown:
        raise InputError(f"out names unknown output(s) {unknown}; the model's outputs are {list(names)}")
    for name, spec in zip(names, buffers):
        target = out.get(name)
        if target is None:
            continue
        if not isinstance(target, np.ndarray) or not target.flags.writeable:
            raise InputError(f"out['{name}'] must be a writable numpy array, got {type(target).__name__}")
        if tuple(target.shape) != tuple(spec.shape) or str(target.dtype) != spec.dtype:
            raise InputError(f"out['{name}'] is {list(target.shape)} {target.dtype}; output '{name}' is "
                             f"{list(spec.shape)} {spec.dtype}")


class WorkspacePool:
    """Idle workspaces; `take()` gives one (a new one when all are in use), `give(ws)` returns it. list.pop
    and list.append are atomic under the GIL, so the pool needs no lock."""

    def __init__(self, make):
        self._make = make
        self._idle: list[Workspace] = []
        self.created = 0

    def take(self) -> Workspace:
        try:
            return self._idle.pop()
        except IndexError:
            self.created += 1
            return self._make()

    def give(self, workspace: Workspace) -> None:
        self._idle.append(workspace)
