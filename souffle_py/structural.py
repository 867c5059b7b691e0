"""A dictionary keyed by TVM IR up to structural equality (buffer and variable names do not count), so
that work done for one function is found again for every equal one: BERT's twelve layers compile,
schedule and tune as one; and deep copies of IR."""

from __future__ import annotations

from typing import Any, Callable, Hashable

import tvm_ffi
from tvm_ffi.serialization import from_json_graph_str, to_json_graph_str


class StructuralMap:
    """{(IR node, extra key): value}, where nodes compare by structural equality and `extra` by ==."""

    def __init__(self) -> None:
        self._buckets: dict[tuple[int, Hashable], list[tuple[Any, Any]]] = {}

    def get(self, node, extra: Hashable = (), default=None):
        bucket = self._buckets.get((tvm_ffi.structural_hash(node), extra), [])
        return next((value for key, value in bucket if tvm_ffi.structural_equal(key, node)), default)

    def has(self, node, extra: Hashable = ()) -> bool:
        return self.get(node, extra, _ABSENT) is not _ABSENT

    def set(self, node, value, extra: Hashable = ()) -> None:
        bucket = self._buckets.setdefault((tvm_ffi.structural_hash(node), extra), [])
        for i, (key, _) in enumerate(bucket):
            if tvm_ffi.structural_equal(key, node):
                bucket[i] = (key, value)
                return
        bucket.append((node, value))

    def setdefault(self, node, make: Callable[[], Any], extra: Hashable = ()):
        """The value of `node`, made by `make()` and stored when there is none."""
        found = self.get(node, extra, _ABSENT)
        if found is _ABSENT:
            found = make()
            self.set(node, found, extra)
        return found


_ABSENT = object()


def deep_copy(node):
    """A copy of `node` sharing no IR node with it (a Schedule made from the only reference to a function
    mutates its nodes in place, even nodes another function shares). Through tvm_ffi's serializer itself:
    `tvm.ir.load_json` first re-parses the text in Python to upgrade old formats, 4 of Inception-v4's 31 s
    of compile time."""
    return from_json_graph_str(to_json_graph_str(node))
