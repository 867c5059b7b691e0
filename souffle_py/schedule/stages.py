"""A merged kernel's compute-intensive stages as functions of their own, and tuned traces replayed on them.

MetaSchedule tunes single-stage functions well and multi-stage ones badly (its schedules of merged CPU
kernels raced, and a whole BERT layer has no design space), so a merged kernel is tuned stage by stage:
each GEMM/conv stage is cut out with its loop nest into a function whose only block is named "stage".
TVM's structural equality ignores buffer and variable names, so the same GEMM in every BERT layer (and in
every position of a kernel) is one workload, one tuning task and one database record.

A record's trace names the blocks it touches ("stage", and the blocks derived from it: "stage_local",
"stage_init", ...); `replay` renames them to the stage's block inside the merged kernel and applies the
trace there, postprocessing included, so the stage is scheduled exactly as it was measured. Queries of the
stage's neighbours that found none on the stage alone are dropped: inside the kernel they find its
epilogue, and TVM refuses a replayed instruction whose number of results changed (so every conv whose
output has a reader kept its default schedule, whatever its measured variants or tuned records said).
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import s_tir, tirx

from souffle_py.failures import RuleDoesNotApply
from souffle_py.schedule.blocks import block_kind
from souffle_py.structural import deep_copy

STAGE = "stage"  # the block name of every extracted stage (what its traces' GetSBlock instructions name)
TUNED_KINDS = ("gemm", "conv")
# schedule queries whose answer depends on the blocks around the stage (a conv's write-back asks for its
# epilogue's block, epilogue.py `fuse_elementwise_epilogue`)
NEIGHBOUR_QUERIES = ("GetConsumers", "GetProducers")


@dataclass(frozen=True)
class Stage:
    """A compute-intensive stage: its block's name in the kernel and the stage alone as a PrimFunc."""

    block: str
    func: tirx.PrimFunc


def compute_stages(func: tirx.PrimFunc) -> list[Stage]:
    """The GEMM/conv stages of `func` that sit alone in a loop nest directly under the root block (a
    recurrence's steps share a time loop and are not extracted), each as a single-stage PrimFunc."""
    realize = func.body
    if not isinstance(realize, s_tir.stmt.SBlockRealize):
        return []
    body = realize.block.body
    nests = list(body.seq) if isinstance(body, tirx.SeqStmt) else [body]
    sch = s_tir.Schedule(func)
    stages = []
    for nest in nests:
        block = _only_block(nest)
        if block is not None and block_kind(sch, sch.get_sblock(block.name_hint)) in TUNED_KINDS:
            stages.append(Stage(block.name_hint, _stage_func(nest, block)))
    return stages


def _only_block(nest):
    """The block at the bottom of a perfect loop nest, or None."""
    while isinstance(nest, tirx.For):
        nest = nest.body
    return nest.block if isinstance(nest, s_tir.stmt.SBlockRealize) else None


def _stage_func(nest, block) -> tirx.PrimFunc:
    """The nest as a function of the buffers its block reads and writes (inputs first), the block renamed
    STAGE; no other names matter to MetaSchedule's structural workload keys."""
    buffers = []
    for region in [*block.reads, *block.writes]:
        if not any(region.source.same_as(b) for b in buffers):
            buffers.append(region.source)
    root = s_tir.stmt.SBlock(iter_vars=[], reads=[], writes=[], name_hint="root", body=_rename_block(nest, block))
    func = tirx.PrimFunc(buffers, s_tir.stmt.SBlockRealize([], True, root))
    func = func.with_attr("global_symbol", "main").with_attr("tirx.noalias", True)
    # a copy sharing no node with the kernel: a Schedule made from the only reference to a function
    # mutates its nodes in place, even nodes another function shares
    return deep_copy(func)


def _rename_block(nest, block):
    if isinstance(nest, tirx.For):
        return tirx.For(nest.loop_var, nest.min, nest.extent, nest.kind, _rename_block(nest.body, block),
                        nest.thread_binding, nest.annotations, nest.step)
    old = nest.block
    new = s_tir.stmt.SBlock(old.iter_vars, old.reads, old.writes, STAGE, old.body, old.init, old.alloc_buffers,
                            old.match_buffers, old.annotations)
    return s_tir.stmt.SBlockRealize(nest.iter_values, nest.predicate, new)


def replay(sch: s_tir.Schedule, block: str, trace: s_tir.schedule.Trace) -> None:
    """Apply a stage's trace (recorded on the stage alone) to the block `block` of the kernel in `sch`."""
    replay_json(sch, block, trace.as_json(remove_postproc=False))


def replay_json(sch: s_tir.Schedule, block: str, trace_json) -> None:
    """`replay` of a trace in its JSON form ([instructions, decisions]), which callers may have edited."""
    insts, decisions = trace_json
    renamed = []
    for inst in insts:
        kind, inputs, attrs, outputs = inst
        if kind in NEIGHBOUR_QUERIES and not outputs:
            continue  # found nothing on the stage alone; inside the kernel it finds the stage's neighbours,
            # and a count that differs from the recorded one fails the whole replay
        if kind == "GetSBlock":
            name = str(attrs[0])
            if name == STAGE or name.startswith(STAGE + "_"):
                attrs = [block + name[len(STAGE):], *attrs[1:]]
        renamed.append([kind, inputs, attrs, outputs])
    try:
        s_tir.schedule.Trace.apply_json_to_schedule([renamed, decisions], sch)
    except tvm.error.InternalError as exc:
        if "new_outputs.size()" in str(exc):
            # an instruction found another number of blocks or loops inside the kernel than on the stage
            # alone (its neighbours, say): the record was made for another structure and does not apply
            # (the caller works on a copy of the schedule, so nothing of the attempt remains)
            raise RuleDoesNotApply(f"a recorded instruction finds another number of blocks or loops at {block} "
                                   f"inside the kernel ({str(exc).strip().splitlines()[-1][:120]})") from exc
        raise
