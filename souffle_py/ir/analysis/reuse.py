"""Data reuse across TEs (paper sec. 5.1): a tensor read by several TEs can be loaded once for all of them.

Spatial reuse: readers with no dependence between them (the Q/K/V GEMMs sharing their input) -- a horizontal
transformation can fuse them and load the tensor once. Temporal reuse: readers that depend on each other (an
LSTM's recurrent weights, read at every time step) -- the tensor can stay on chip from one to the next.
Dependence between readers comes from ancestor bitsets (Python ints), one OR per edge.
"""

from __future__ import annotations

from dataclasses import dataclass

from souffle_py.ir.analysis.tensor_level import TensorInfo


@dataclass(frozen=True)
class SpatialReuse:
    """s(t): the TEs reading `tensor`; `independent` is a set of them with no dependence between any two
    (chosen greedily in program order), the candidates for a horizontal transformation."""

    tensor: str
    bytes: int
    readers: tuple[str, ...]
    independent: tuple[str, ...]


@dataclass(frozen=True)
class TemporalReuse:
    """A tensor read again by TEs that depend on an earlier reader of it.

    rereads: readers that depend on an earlier reader (each would reload the tensor); span: program-order
    distance from the first to the last reader; saved_bytes = bytes * rereads, the traffic that keeping the
    tensor on chip avoids.
    """

    tensor: str
    kind: str  # of the tensor: "param", "input", "intermediate" or "output"
    bytes: int
    readers: tuple[str, ...]
    rereads: int
    span: int
    saved_bytes: int


def ancestors(producers: list[list[int]]) -> list[int]:
    """Bitset per TE (bit j: TE j is an ancestor), from each TE's producer TEs; TEs in program order."""
    bits: list[int] = []
    for deps in producers:
        acc = 0
        for j in deps:
            acc |= bits[j] | (1 << j)
        bits.append(acc)
    return bits


def find_reuse(tensors: dict[str, TensorInfo], te_names: list[str]) -> tuple[list[SpatialReuse], list[TemporalReuse]]:
    """Every tensor read by more than one TE, as spatial reuse, and as temporal reuse where readers depend on
    each other; both sorted largest first (by independent readers then bytes; by saved bytes)."""
    position = {name: i for i, name in enumerate(te_names)}
    producers: list[list[int]] = [[] for _ in te_names]
    for info in tensors.values():
        if info.producer is not None:
            for reader in info.readers:
                producers[position[reader]].append(position[info.producer])
    anc = ancestors(producers)
    spatial, temporal = [], []
    for info in tensors.values():
        if len(info.readers) < 2:
            continue
        idx = [position[r] for r in info.readers]
        chosen: list[int] = []
        for i in idx:
            if all(not (anc[i] >> j) & 1 for j in chosen):  # readers come in program order: j never depends on i
                chosen.append(i)
        spatial.append(SpatialReuse(info.name, info.bytes, info.readers, tuple(te_names[i] for i in chosen)))
        earlier = 0
        rereads = 0
        for i in idx:
            rereads += bool(anc[i] & earlier)
            earlier |= 1 << i
        if rereads:
            temporal.append(TemporalReuse(info.name, info.kind, info.bytes, info.readers, rereads,
                                          idx[-1] - idx[0], info.bytes * rereads))
    def first(reuse):  # ties keep program order
        return position[reuse.readers[0]]

    spatial.sort(key=lambda s: (-len(s.independent), -s.bytes, first(s)))
    temporal.sort(key=lambda t: (-t.saved_bytes, first(t)))
    return spatial, temporal
