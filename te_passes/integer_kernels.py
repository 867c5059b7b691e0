"""The int8 pass: GEMMs and convolutions of dequantized int8 operands (QDQ models) as integer kernels
(int8_gemm.py, int8_conv.py), in one sweep over the program."""

from __future__ import annotations

import logging

from souffle_py.program import TEProgram
from te_passes.graph import rebuild_reading, sweep
from te_passes.int8_conv import integer_conv
from te_passes.int8_gemm import integer_gemm

log = logging.getLogger(__name__)


def integer_kernels(program: TEProgram, vnni_lanes: int = 0) -> TEProgram:
    """`program` with every GEMM and convolution of dequantized int8 operands (a constant weight) as an
    integer GEMM or convolution, element for element; GEMMs in vpdpbusd's form where `vnni_lanes`."""
    params, param_tensors = dict(program.params), dict(program.param_tensors)
    made = []

    def rewrite(op, reads):
        current = rebuild_reading(op, reads, {})
        new = integer_gemm(program, current, params, param_tensors, vnni_lanes)
        new = new if new is not None else integer_conv(program, current, params, param_tensors)
        if new is not None:
            made.append(op.name)
        return new

    new_of, replaced = sweep(program.stages, rewrite)
    if not replaced:
        return program
    log.info("integer kernels: %s", ", ".join(made))
    return program.rebuilt(new_of, params, param_tensors)
