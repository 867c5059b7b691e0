"""The int8 pass: GEMMs and convolutions of dequantized int8 operands (QDQ models) as integer kernels
(int8_gemm.py, int8_conv.py) with their requantization fused (int8_requant.py), in one sweep."""

from __future__ import annotations

import logging

from souffle_py.ir.program import TEProgram
from souffle_py.ir.graph import rebuild_reading, sweep
from te_passes.int8_conv import integer_conv
from te_passes.int8_gemm import integer_gemm, vnni_form
from te_passes.int8_pool import integer_max_pool
from te_passes.int8_requant import fused_requantize

log = logging.getLogger(__name__)


def integer_kernels(program: TEProgram, vnni_lanes: int = 0, split: bool = False, may_saturate=None) -> TEProgram:
    """`program` with every GEMM and convolution of dequantized int8 operands (a constant weight) as an
    integer GEMM or convolution, element for element; GEMMs in vpdpbusd's form where `vnni_lanes` (the
    frontend's integer GEMMs of QOperator and dynamically quantized models too); the QuantizeLinear after
    such a GEMM or convolution (and its bias) requantizes its int32 sum directly (int8_requant.py). `split`:
    the target's exact dot product reads its weights split into int16 halves (dot_weights.py);
    `may_saturate(zero_point)`: whether a stage whose uint8 activations have that zero point (None: set at
    run time) may take the saturating form instead (dot_weights.pair_form; int8="saturating")."""
    params, param_tensors = dict(program.params), dict(program.param_tensors)
    made, copies = [], {}

    def rewrite(op, reads):
        current = rebuild_reading(op, reads, {})
        new = integer_gemm(program, current, params, param_tensors, vnni_lanes, split, copies, may_saturate)
        new = new if new is not None else integer_conv(program, current, params, param_tensors, vnni_lanes, copies,
                                                       split, may_saturate)
        new = new if new is not None else vnni_form(program, current, params, param_tensors, vnni_lanes, split,
                                                    copies, may_saturate)
        new = new if new is not None else fused_requantize(program, current, params, param_tensors)
        new = new if new is not None else integer_max_pool(program, current)
        if new is not None:
            made.append(op.name)
        return new

    new_of, replaced = sweep(program.stages, rewrite)
    if not replaced:
        return program
    log.info("integer kernels: %s", ", ".join(made))
    return program.rebuilt(new_of, params, param_tensors)
