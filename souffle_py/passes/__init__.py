"""Every rewrite of the TE program, registered per target (manager.py: the pass manager; cpu.py and
cuda.py: each target's ordered list). `prepared` runs a backend's list as `optimize` does; `transformed`
the SOUFFLE transformations alone (analysis and tests), over `conv_weights_blocked`'s program."""

from __future__ import annotations

from souffle_py.passes.manager import Pass, PassContext, PassRecord, run_passes, select

__all__ = ["Pass", "PassContext", "PassRecord", "conv_weights_blocked", "passes_for", "prepared", "run_passes",
           "select", "transformed"]


def passes_for(device: str) -> tuple[Pass, ...]:
    """The ordered passes of a backend's device ("cpu" or "cuda")."""
    if device == "cuda":
        from souffle_py.passes.cuda import CUDA_PASSES

        return CUDA_PASSES
    from souffle_py.passes.cpu import CPU_PASSES

    return CPU_PASSES


def prepared(program, backend, passes="all", precision: str = "fp32", merge: bool = True, only=None):
    """`program` after the passes of `backend`'s list that `passes` selects (select()), restricted to the
    names in `only` when given."""
    steps = passes_for(backend.device)
    enabled = select(passes, steps)
    if only is not None:
        enabled = enabled & frozenset(only)
    return run_passes(program, steps, PassContext(backend, precision, merge), enabled)[0]


def conv_weights_blocked(program):
    """The frontend's `program` with its conv weights blocked as the CPU compiled for blocks them
    (block_conv_weights with CpuTarget.current()'s blocks: the host's outside a compile), the form the
    SOUFFLE transformations, the analyses and the layout passes read; a program already blocked as it is."""
    from souffle_py.schedule.conv import conv_weight_blocks
    from te_passes.conv_weights import block_conv_weights

    return block_conv_weights(program, conv_weight_blocks())[0]


def transformed(program, passes="all"):
    """(program, records) after the SOUFFLE transformations `passes` selects (vertical, horizontal), over
    `program` with its conv weights blocked (conv_weights_blocked)."""
    from souffle_py.passes.transformations import TRANSFORMATIONS

    return run_passes(conv_weights_blocked(program), TRANSFORMATIONS, PassContext(), select(passes, TRANSFORMATIONS))
