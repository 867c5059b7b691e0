"""Pack constant GEMM weights into column panels: W[K, N] becomes Wp[N / P, K, P], read as Wp[j // P, k, j % P].

A register tile of the default CPU GEMM (schedule/default.py) reads P consecutive columns of W at every k.
In the row-major weight those P floats sit 4 * N bytes after the previous k's, so a tile's pass over K
touches K separate lines spread over K * N * 4 bytes; packed, the pass reads one contiguous K * P block
that the prefetchers stream. BERT-base's GEMMs went from 350-480 to ~490 GFLOP/s (510-520 with the
schedule's L2 column chunks; an LSTM's 100 x 1024 x 256 input projection 365 -> 460), the way ONNX
Runtime's MLAS prepacks its weights. P is the default GEMM's column tile (TILE_J): the schedule keeps that
tile width for packed weights, so every vector load stays contiguous. Values are unchanged: this is a
compile-time layout change of constants.
"""

from __future__ import annotations

import numpy as np
import tvm
import tvm_ffi
from tvm import te

from souffle_py.ir.program import TEProgram
from souffle_py.ir.exprs import substitute
from souffle_py.ir.graph import rebuild_reading, tensor_key, tensor_loads
from te_passes.patterns import product_reduction
from souffle_py.ir.marks import member_of


MIN_ROWS = 4  # fewer rows is a GEMV, whose wide register tile (1 x 256) beats any panel-wide one


def pack_weights(program: TEProgram, panel: int) -> TEProgram:
    """`program` with the constant [.., K, N] weights of its GEMM TEs (at least MIN_ROWS rows per weight,
    N a multiple of `panel`) packed in `panel`-column panels, [.., N / P, K, P]; recurrence steps are left
    alone (their GEMV runs per step). Leading weight axes are output axes of the GEMM (a bidirectional
    recurrence's input projection reads W[d, k, j]): each of their weights is packed alike. Weights stored
    transposed, [.., N, K] and read as W[.., j, k] (ONNX Gemm with transB, as torch exports nn.Linear over
    2-D inputs: ViT-B/16's attention output projections ran at 85 GFLOP/s, every column lane a separate
    load), are packed into the same panels."""
    def relayout(value):
        lead = len(value.shape) - 2
        blocks = value.reshape(*value.shape[:-1], value.shape[-1] // panel, panel)
        return blocks.transpose(*range(lead), lead + 1, lead, lead + 2)
    def read(panels):  # W[.., k, j]
        return lambda *idx: panels[(*idx[:-2], idx[-1] // panel, idx[-2], idx[-1] % panel)]
    program = _relayout_weights(program, lambda op: _packable_weight(program, op, panel), f"_panels{panel}",
                                relayout, read)
    return _relayout_weights(  # W[.., j, k]: the same panels of the swapped weight, its indices swapped
        program, lambda op: _packable_weight(program, op, panel, transposed=True), f"_panels{panel}t",
        lambda value: relayout(np.swapaxes(value, -1, -2)),
        lambda panels: lambda *idx: read(panels)(*idx[:-2], idx[-1], idx[-2]))


def _relayout_weights(program: TEProgram, weight_of, suffix: str, relayout, read) -> TEProgram:
    """The sweep of the weight-layout passes: the constant [.., K, N] weight that `weight_of(op)` finds in
    an op is stored once as `relayout(value)` (named with `suffix`), and every such op reads W[.., k, j]
    through `read(new tensor)(.., k, j)`. Values are unchanged."""
    relaid: dict[str, te.Tensor] = {}
    params, param_tensors = dict(program.params), dict(program.param_tensors)
    new_of: dict[tuple, te.Tensor] = {}
    for op in program.stages:
        weight = weight_of(op)
        if weight is not None and weight.op.name not in relaid:
            name = fresh_name(f"{weight.op.name}{suffix}", params)
            params[name] = np.ascontiguousarray(relayout(program.params[weight.op.name]))
            param_tensors[name] = relaid[weight.op.name] = te.placeholder(
                params[name].shape, str(params[name].dtype), name=name)
        mapping = dict(new_of)
        if weight is not None:
            mapping[tensor_key(weight)] = read(relaid[weight.op.name])
        rebuild_reading(op, mapping, new_of)
    if not relaid:
        return program
    return program.rebuilt(new_of, params, param_tensors)


def _packable_weight(program: TEProgram, op: te.ComputeOp, panel: int,
                     transposed: bool = False) -> te.Tensor | None:
    """The constant [.., K, N] weight that `op` (a GEMM: one reduction, a product of two reads, at least
    MIN_ROWS rows per weight) reads as W[.., k, j] with j its last axis, N a multiple of `panel` and the
    leading indices other axes of `op` (`transposed`: a [.., N, K] weight read as W[.., j, k]); else None."""
    product = product_reduction(op)
    if product is None or len(op.reduce_axis) != 1 or not op.axis or member_of(op) is not None:
        return None
    k, j = op.reduce_axis[0].var, op.axis[-1].var
    inner, outer = (k, j) if transposed else (j, k)
    for load in product.loads:
        tensor, indices = load.args[0], list(load.args[1:])
        if not (program.placeholder_kind(tensor) == "param" and len(indices) >= 2
                and indices[-2].same_as(outer) and indices[-1].same_as(inner) and str(tensor.dtype) == "float32"):
            continue
        lead = indices[:-2]
        axes = [iv for iv in op.axis[:-1] if not any(iv.var.same_as(i) for i in lead)]
        if len(axes) != len(op.axis) - 1 - len(lead):  # a leading index that is not an axis of op
            continue
        rows = int(np.prod([int(iv.dom.extent) for iv in axes]))
        if int(tensor.shape[-2 if transposed else -1]) % panel == 0 and rows >= MIN_ROWS:
            return tensor
    return None


def transpose_gemv_weights(program: TEProgram, max_rows: int) -> TEProgram:
    """`program` with the constant [K, N] weights of its GEMVs (fewer than `max_rows` rows, recurrence
    steps included) stored transposed, [N, K], and read as Wt[j, k]: a GPU reduces each output with a warp
    whose lanes then read adjacent elements of one weight row (backends/cuda/grid.py; dlight's GEMV rule
    likewise wants the reduction innermost). Values are unchanged: a compile-time layout of constants."""
    return _relayout_weights(program, lambda op: _gemv_weight(program, op, max_rows), "_t",
                             lambda value: value.T, lambda transposed: lambda kk, j: transposed[j, kk])


def _gemv_weight(program: TEProgram, op: te.ComputeOp, max_rows: int) -> te.Tensor | None:
    """The constant [K, N] weight that `op` (one reduction, fewer than `max_rows` rows per time step) reads
    as W[k, j], j its last axis, also under a guard (a wavefront step's); else None."""
    if len(op.reduce_axis) != 1 or not op.axis or not isinstance(op.body[0], tvm.tirx.Reduce):
        return None
    per_step = op.axis[1:-1] if member_of(op) is not None else op.axis[:-1]  # a recurrence: one step's rows
    rows = int(np.prod([int(iv.dom.extent) for iv in per_step]))
    k, j = op.reduce_axis[0].var, op.axis[-1].var
    for load in tensor_loads(op.body[0].source[0]):
        tensor, indices = load.args[0], list(load.args[1:])
        if program.placeholder_kind(tensor) == "param" and len(indices) == 2 and indices[0].same_as(k) \
                and indices[1].same_as(j) and rows < max_rows:
            return tensor
    return None


def fresh_name(base: str, taken) -> str:
    """`base`, or `base` with the first free numeric suffix, not in `taken`."""
    name, n = base, 1
    while name in taken:
        name, n = f"{base}_{n}", n + 1
    return name



def transpose_operands(program: TEProgram) -> TEProgram:
    """`program` with each GEMM operand that is read across its columns (B[j, k]: attention's Q.K^T reads
    K's rows as columns, 2304 floats apart in BERT's fused QKV) first copied into [.., k, j] order by a
    transpose TE of its own. The default GEMM vectorizes over the columns j: read in place, every vector
    lane is a separate load (BERT-base's scores ran at 30-45 GFLOP/s); from the copy, one contiguous
    vector load. Constants are left to `pack_weights`; recurrence steps keep their reads."""
    new_of: dict[tuple, te.Tensor] = {}
    for op in program.stages:
        current = rebuild_reading(op, new_of, new_of)
        load = _column_read(program, current)
        if load is not None:
            new_of[tensor_key(op.output(0))] = _reading_transposed(current, load).output(0)
    return program.rebuilt(new_of) if new_of else program


def _column_read(program: TEProgram, op) -> tvm.ir.Call | None:
    """The operand read of a GEMM `op` (one reduction k, a product of two reads, columns j its last axis)
    that depends on j, k and batch axes only, with j in an earlier index than the last one, which varies
    with k: a computed tensor read across its columns. None if there is none, or where the [.., k, j] copy
    would hold more elements than the tensor: a read that repeats rows over the columns (two stacked
    classifier GEMVs, X[j // 1000, k]: a 384 x 2000 copy of 768 floats per inference) is a broadcast the
    GEMV reads in place, along k."""
    product = product_reduction(op)
    if product is None or len(op.reduce_axis) != 1 or len(op.axis) < 2 or member_of(op) is not None:
        return None
    k, j, row = op.reduce_axis[0].var, op.axis[-1].var, op.axis[-2].var
    allowed = {v.var.__chandle__() for v in op.axis[:-2]} | {k.__chandle__(), j.__chandle__()}
    for load in product.loads:
        tensor, indices = load.args[0], list(load.args[1:])
        if isinstance(tensor.op, te.PlaceholderOp) and program.placeholder_kind(tensor) == "param":
            continue
        used = [_vars(i) for i in indices]
        if not indices or not set().union(*used) <= allowed or row.__chandle__() in set().union(*used):
            continue
        if j.__chandle__() in used[-1] or k.__chandle__() not in used[-1]:
            continue
        if any(j.__chandle__() in u for u in used[:-1]) and _copy_size(op) <= _size(tensor):
            return load
    return None


def _size(tensor) -> int:
    return int(np.prod([int(d) for d in tensor.shape]))


def _copy_size(op) -> int:
    """Elements of the [*batch, k, j] copy `_reading_transposed` makes for `op`."""
    return int(np.prod([int(iv.dom.extent) for iv in (*op.axis[:-2], *op.reduce_axis, op.axis[-1])]))


def _vars(expr) -> set:
    found = set()
    tvm_ffi.structural_walk(expr, [(tvm.tirx.Var, lambda v: found.add(v.__chandle__()))])
    return found


def _reading_transposed(op, load) -> te.ComputeOp:
    """`op` reading `load` from a copy laid out [*batch, k, j] instead."""
    batch, k, j = list(op.axis[:-2]), op.reduce_axis[0], op.axis[-1]
    tensor, indices = load.args[0], list(load.args[1:])
    extents = [int(iv.dom.extent) for iv in batch] + [int(k.dom.extent), int(j.dom.extent)]

    def copy(*axes):
        mapping = {iv.var.__chandle__(): a for iv, a in zip([*batch, k, j], axes)}
        return tensor(*[substitute(i, mapping) for i in indices])

    transposed = te.compute(extents, copy, name=f"{op.name}_operand_t")
    replacement = transposed(*[iv.var for iv in batch], k.var, j.var)

    def visit(call):
        if call.op.same_as(load.op) and call.args[0].same_as(tensor) and \
                tvm_ffi.structural_equal(list(call.args[1:]), indices):
            return replacement
        return call

    body = tvm_ffi.structural_map(op.body[0], [(tvm.ir.Call, visit)])
    return te.ComputeOp(op.name, op.tag, op.attrs, op.axis, op.reduce_axis, [body])
