"""Test helpers for the CUDA backend on machines without a GPU."""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx

from souffle_py.backends.cuda.launches import thread_aliased_blocks
from souffle_py.backends.cuda.warps import WARP_SYNC
from souffle_py.backends.cuda.specs import gpu_present

HAS_GPU = gpu_present()


def compiled_case(models, case):
    """(name, precision, target, the model compiled for them): a module fixture's value for one
    (name, precision, target) case of a reduced-precision CUDA test (`models`: name -> ONNX model builder)."""
    import souffle_py
    name, precision, target = case
    return name, precision, target, souffle_py.optimize(models[name](), target=target, precision=precision,
                                                        quiet=True)


def threads_as_loops(func: tirx.PrimFunc, check: bool = True) -> tirx.PrimFunc:
    """`func` with every GPU thread binding turned into a serial loop, so that LLVM can run it on the CPU.
    Valid for schedules whose threads do not cooperate through shared memory (one thread per output
    element, a host time loop): each thread's work then runs in turn, in launch order. A cooperative
    shared-memory load (thread loops nested in the same threads' loops) then runs whole in each thread,
    which is what the block's threads load together only if it does not use the outer loops' thread
    index: such a load is refused here (`thread_aliased_blocks`), since its CPU run would not be the GPU's."""
    if check:
        _check_not_aliased(func)

    def serial(loop):
        if loop.kind != tirx.ForKind.THREAD_BINDING:
            return loop
        return tirx.For(loop.loop_var, loop.min, loop.extent, tirx.ForKind.SERIAL, loop.body)

    def no_warp_sync(stmt):  # threads run one after another: a warp's writes are already visible
        call = stmt.value
        if isinstance(call, tvm.ir.Call) and call.op.name == "tirx.call_extern" and call.args[0].value == WARP_SYNC:
            return tirx.Evaluate(0)
        return stmt

    return tvm_ffi.structural_map(func, [(tirx.For, serial), (tirx.Evaluate, no_warp_sync)])


def _check_not_aliased(func) -> None:
    aliased = thread_aliased_blocks(func)
    assert not aliased, f"blocks {aliased} read a thread index another loop of that thread shadows"


def grid_phases_as_loops(func: tirx.PrimFunc, reverse: bool = False) -> tirx.PrimFunc:
    """A grid-synchronized kernel as the CPU can run it: the code between two grid barriers (a phase) runs
    for every block and thread before the next phase starts, which is what the barrier guarantees on the
    GPU; inside a phase, threads run one after another (`threads_as_loops`). A barrier that is missing
    between dependent stages shows as a wrong result whenever a thread reads an element that a later
    thread of the same phase writes. `reverse` runs the blocks (of phases without shared-memory tiles)
    and warps of each phase last to first (lanes stay in order: a warp's lane 0 still writes before its
    other lanes read, as after __syncwarp), so that a read of an element an earlier block or warp writes
    in the same phase shows too: the GPU gives no order between them."""
    from souffle_py.backends.cuda.barriers import GRID_SYNC

    def is_sync(stmt):
        return isinstance(stmt, tirx.Evaluate) and getattr(stmt.value, "op", None) is not None \
            and getattr(stmt.value.op, "name", "") == GRID_SYNC

    def split(stmts, wrap):
        out, phase = [], []
        for stmt in stmts:
            if is_sync(stmt):
                if phase:
                    out.append(wrap(phase))
                phase = []
            elif isinstance(stmt, tirx.For) and _contains_sync(stmt.body, is_sync):
                if phase:
                    out.append(wrap(phase))
                phase = []
                body = stmt.body.seq if isinstance(stmt.body, tirx.SeqStmt) else [stmt.body]
                out.append(tirx.For(stmt.loop_var, stmt.min, stmt.extent, tirx.ForKind.SERIAL,
                                    _seq(split(list(body), wrap)), None, stmt.annotations))
            else:
                phase.append(stmt)
        if phase:
            out.append(wrap(phase))
        return out

    def visit(block_loop):
        if block_loop.kind != tirx.ForKind.THREAD_BINDING or str(block_loop.thread_binding.thread_tag) != "blockIdx.x":
            return block_loop
        thread_loop = block_loop.body
        body = thread_loop.body
        stmts = list(body.seq) if isinstance(body, tirx.SeqStmt) else [body]

        def wrap(phase):
            b = tirx.Var(block_loop.loop_var.name, block_loop.loop_var.ty)
            t = tirx.Var(thread_loop.loop_var.name, thread_loop.loop_var.ty)
            # grid kernels only (blocks x warps); the blocks rotated by half the grid, not reversed: TVM's
            # simplifier turns (E - 1 - b) % 8 into (7 - b) % 8, which its CPU code gets wrong for b > 7
            shuffle = reverse and thread_loop.thread_binding is not None \
                and str(thread_loop.thread_binding.thread_tag) == "threadIdx.y"
            b_at = tirx.floormod(b + int(block_loop.extent) // 2, block_loop.extent) if shuffle else b
            t_at = thread_loop.extent - 1 - t if shuffle else t
            body = tvm_ffi.structural_map(_seq(phase), [(tirx.Var, lambda v: b_at if v.same_as(block_loop.loop_var)
                                                         else t_at if v.same_as(thread_loop.loop_var) else v)])
            return tirx.For(b, 0, block_loop.extent, tirx.ForKind.SERIAL,
                            tirx.For(t, 0, thread_loop.extent, tirx.ForKind.SERIAL, body))

        return _seq(split(stmts, wrap))

    return tvm_ffi.structural_map(func, [(tirx.For, visit)])


def _seq(stmts):
    return stmts[0] if len(stmts) == 1 else tirx.SeqStmt(stmts)


def _contains_sync(stmt, is_sync) -> bool:
    found = []
    tvm_ffi.structural_walk(stmt, [(tirx.Evaluate, lambda e: found.append(is_sync(e)))])
    return any(found)


def run_phases_on_cpu(program, kernels, functions, function_of, phases=True, reverse=False):
    """The GPU kernels run on the CPU: grid phases one after another, threads as loops (blocks and warps
    last to first with `reverse`)."""
    from souffle_py.plan import plan_for
    from souffle_py.runtime import CompiledModel

    cpu = tvm.target.Target("llvm")
    for func in functions.values():
        _check_not_aliased(func)
    prepared = {n: threads_as_loops(grid_phases_as_loops(f, reverse) if phases else f, check=False)
                .without_attr("tirx.kernel_launch_params") for n, f in functions.items()}
    module = tvm.compile(tvm.IRModule(prepared), target=cpu)
    plan = plan_for(program, kernels, function_of, len(functions), cpu, "cpu")
    return CompiledModel(plan, module, program.params)


SYNCS = ("grid_sync()", "__syncthreads", "__syncwarp", "__shfl")


def syncs_in_divergent_code(source: str) -> list[str]:
    """Lines of CUDA `source` that synchronize (a grid or block barrier, __syncwarp, a warp shuffle) inside
    an `if`, `else` or loop whose condition reads a thread index (a block index too, for a grid barrier):
    some threads would wait at a barrier the others never reach, or shuffle with lanes that are not there.
    (A condition on the block index alone holds for all the block's threads: a tensor-core stage's count
    of tiles per block.) The CPU runs cannot show this (their threads run one after another), so the
    generated source is checked."""
    found, opened = [], []
    for line in source.splitlines():
        text = line.strip()
        if any(sync in text for sync in SYNCS) and "__device__" not in text and "#define" not in text:
            index = "Idx" if "grid_sync" in text else "threadIdx"
            if any(o.startswith(("if", "} else", "for", "while")) and index in o for o in opened):
                found.append(text)
        if text.startswith("}") and opened:
            opened.pop()
        if text.endswith("{"):
            opened.append(text)
    return found
