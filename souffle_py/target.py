"""Targets by name: "llvm"/"cpu", "cuda", "h100", "h200", "a100" or a tvm Target (see souffle_py/backends)."""

from __future__ import annotations

import tvm

from souffle_py.host import num_threads  # noqa: F401  (re-exported: scripts and tests use it)


def resolve_target(target: "str | tvm.target.Target") -> tvm.target.Target:
    """The tvm Target souffle-py compiles for when given `target`."""
    from souffle_py.backends import backend_for

    return backend_for(target).target
