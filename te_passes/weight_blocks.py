"""Weights blocked by output channel (the conv weight [F/B, C, *k, B] of block_conv_weights, read at
f // B and f % B) concatenated by channel: how horizontal fusion gives the 1x1 convs of one input (an inception
module's branches) one weight, re-blocked, instead of a chain of predicates per multiply-add. Pure
functions over index expressions and numpy arrays."""

from __future__ import annotations

import numpy as np
import tvm
import tvm_ffi
from tvm import tirx
from tvm.ir.prim import expr as pe


def blocked_position(indices, var, shape) -> tuple[int, int] | None:
    """(p, B) where `indices` read a weight blocked by B along `var`: var // B at position p and var % B last,
    B the last extent; else None."""
    def step(expr, kind) -> int | None:
        if isinstance(expr, kind) and isinstance(expr.a, tvm.ir.Var) and expr.a.same_as(var) \
                and isinstance(expr.b, pe.IntImm):
            return int(expr.b.value)
        return None
    if len(indices) < 2 or step(indices[-1], tirx.FloorMod) != int(shape[-1]):
        return None
    found = [(p, b) for p, i in enumerate(indices[:-1]) if (b := step(i, tirx.FloorDiv)) is not None]
    if len(found) != 1 or found[0][1] != int(shape[-1]):
        return None
    return found[0]


def reblocking(found, indices, values, extents) -> tuple[int, int] | None:
    """(p, B) when every member's weight is blocked (`found`: blocked_position per member) at the same
    position p, possibly by different blocks, their other indices (`indices`, in combined coordinates) agree
    and their channels are the members' `extents`: the channels concatenate, re-blocked by the largest
    member block B dividing the total (GoogLeNet's 64 + 96 + 16 filters: one [11, C, 1, 1, 16] weight)."""
    if None in found or len({p for p, _ in found}) != 1:
        return None
    at = found[0][0]
    middle = [[i for q, i in enumerate(idx) if q not in (at, len(idx) - 1)] for idx in indices]
    same = all(len(m) == len(middle[0]) and all(tvm_ffi.structural_equal(a, b) for a, b in zip(m, middle[0]))
               for m in middle)
    if not same or len({v.shape[:at] + v.shape[at + 1:-1] for v in values}) != 1 or \
            [channels_of(v, at) for v in values] != list(extents):
        return None
    total = sum(extents)
    block = max((b for _, b in found if total % b == 0), default=0)
    return (at, block) if block else None


def channels_of(blocked: np.ndarray, at: int = 0) -> int:
    """Channels of a weight blocked at position `at` (blocks x the last extent)."""
    return blocked.shape[at] * blocked.shape[-1]


def reblocked(values, at: int, block: int) -> np.ndarray:
    """Blocked weights [.., F_k / B_k at `at`, .., B_k] concatenated by channel and blocked by `block`."""
    plain = [np.moveaxis(v, -1, at + 1).reshape(v.shape[:at] + (channels_of(v, at),) + v.shape[at + 1:-1])
             for v in values]
    whole = np.concatenate(plain, axis=at)
    shape = whole.shape[:at] + (whole.shape[at] // block, block) + whole.shape[at + 1:]
    return np.ascontiguousarray(np.moveaxis(whole.reshape(shape), at + 1, -1))
