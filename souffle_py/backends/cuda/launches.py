"""Launch nests of a scheduled GPU PrimFunc: each becomes one device kernel (TVM's SplitHostDevice), with
a grid of blockIdx extents and a block of threadIdx extents, launched once per iteration of the host
loops around it (a recurrence's time loop outside a grid-synchronized kernel).

Also the check that a schedule bound every block to GPU threads: TVM builds an unbound block as host
code that writes device memory, which fails only at run time, on the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import tvm_ffi
from tvm import s_tir, tirx
from tvm.sym import Analyzer


@dataclass(frozen=True)
class LaunchNest:
    blocks: int
    threads: int
    launches_per_call: int


def child_statements(stmt) -> list:
    """The statements directly inside `stmt` (a block's init and body, both branches of an if)."""
    if isinstance(stmt, tirx.SeqStmt):
        return list(stmt.seq)
    if isinstance(stmt, s_tir.stmt.SBlockRealize):
        block = stmt.block
        return [x for x in (block.init, block.body) if x is not None]
    if isinstance(stmt, tirx.IfThenElse):
        return [x for x in (stmt.then_case, stmt.else_case) if x is not None]
    body = getattr(stmt, "body", None)
    return [body] if body is not None else []


def _thread_tag(loop) -> str | None:
    if isinstance(loop, tirx.For) and loop.kind == tirx.ForKind.THREAD_BINDING and loop.thread_binding is not None:
        return str(loop.thread_binding.thread_tag)
    return None


def launch_nests(func: tirx.PrimFunc) -> list[LaunchNest]:
    """The device kernels of `func` in the order TVM names them (`<symbol>_kernel`, `_kernel_1`, ...)."""
    nests: list[LaunchNest] = []

    def visit(stmt, host_trips: int) -> None:
        if _thread_tag(stmt) is not None:
            extents: dict[str, int] = {}
            _collect(stmt, extents)
            blocks = prod(v for k, v in extents.items() if k.startswith("blockIdx")) or 1
            threads = prod(v for k, v in extents.items() if k.startswith("threadIdx")) or 1
            nests.append(LaunchNest(blocks, threads, host_trips))
            return
        trips = host_trips * int(stmt.extent) if isinstance(stmt, tirx.For) else host_trips
        for child in child_statements(stmt):
            visit(child, trips)

    visit(func.body, 1)
    return nests


def _collect(stmt, extents: dict[str, int]) -> None:
    tag = _thread_tag(stmt)
    if tag is not None:
        extents[tag] = max(extents.get(tag, 1), int(stmt.extent))
    for child in child_statements(stmt):
        _collect(child, extents)


def unbound_blocks(func: tirx.PrimFunc) -> list[str]:
    """Names of the blocks with a store that no GPU thread binding encloses (it would run on the host)."""
    unbound: list[str] = []

    def visit(stmt, bound: bool, block: str) -> None:
        if _thread_tag(stmt) is not None:
            bound = True
        if isinstance(stmt, s_tir.stmt.SBlockRealize):
            block = stmt.block.name_hint
        if isinstance(stmt, tirx.BufferStore) and not bound and block not in unbound:
            unbound.append(block)
        for child in child_statements(stmt):
            visit(child, bound, block)

    visit(func.body, False, "root")
    return unbound



def thread_aliased_blocks(func: tirx.PrimFunc) -> list[str]:
    """Names of the blocks that use the variable of a thread loop from inside another loop bound to the
    same thread. On the GPU both loops are one hardware index (a cooperative shared-memory load nested in
    the compute's thread loops), so such a block computes other elements than its TIR says; run on the
    CPU, each thread runs the inner loop whole, and the difference does not show. A shared load whose
    region was made for one thread (compute_at before the threads were bound) looks like this. A clause
    of the block's predicate that is another of its clauses with each outer thread variable read as the
    inner one (the compute's guard `thread < 128`, copied onto a load guarded so itself) is the same
    guard on the GPU, and allowed."""
    aliased: list[str] = []
    analyzer = Analyzer()

    def uses(expr, variables) -> bool:
        found: list = []
        tvm_ffi.structural_walk(expr, [(tirx.Var, lambda v: found.append(any(v.same_as(s) for s in variables)))])
        return any(found)

    def visit(stmt, bound: dict, shadowed: dict) -> None:
        tag = _thread_tag(stmt)
        if tag is not None and tag.startswith("threadIdx"):
            if tag in bound:
                shadowed = {**shadowed, bound[tag]: stmt.loop_var}
            bound = {**bound, tag: stmt.loop_var}
        if isinstance(stmt, s_tir.stmt.SBlockRealize) and shadowed:
            outer = list(shadowed)
            clauses = _clauses(stmt.predicate)
            own = [analyzer.simplify(c) for c in clauses]
            bad = any(uses(value, outer) for value in stmt.iter_values) or any(
                uses(clause, outer) and not any(tvm_ffi.structural_equal(analyzer.simplify(tvm_ffi.structural_map(
                    clause, [(tirx.Var, lambda v: next((shadowed[o] for o in outer if o.same_as(v)), v))])), o)
                    for o in own) for clause in clauses)
            if bad and stmt.block.name_hint not in aliased:
                aliased.append(stmt.block.name_hint)
        for child in child_statements(stmt):
            visit(child, bound, shadowed)

    visit(func.body, {}, {})
    return aliased


def _clauses(predicate) -> list:
    if isinstance(predicate, tirx.And):
        return _clauses(predicate.a) + _clauses(predicate.b)
    return [predicate]
