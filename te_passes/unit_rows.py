"""1-D convolution networks as 2-D ones over a single row (CPU backend): [N, C, W] -> [N, C, 1, W].

The channel-blocked layouts, the dense conv's register tile and its schedule are written for 2-D maps
(channel_blocks.py, conv_layout.py). A Conv1d (audio front ends: Whisper's two convs, wav2vec2's seven;
temporal CNNs) ran outside them as a generic 3-D reduction with an NCW output transposed element by
element: wav2vec2's 512 -> 512 k3/s2 convs at 125-178 GFLOP/s, 1.5x ONNX Runtime. Lifted here, each such
conv is a 1 x k conv over one row, and the TEs around it that work channel by channel (pads, bias, batch
norm, activations, residual adds, per-channel reductions) become 4-D maps too, so the 2-D machinery blocks
and schedules the whole network without a rule of its own.

Values are unchanged: a lifted TE computes out[n, c, 0, w] = old[n, c, w], and every reader (lifted or
not) reads it at [n, c, 0, w], an index change and no copy. A TE is lifted only within a network grown
from the 1-D convs through channel-wise TEs (each 3-D map read at the TE's own channel); a transpose to
[N, W, C] (Whisper's hand-over to its transformer) reads across channels and stays as it is. Model outputs
keep their shapes.
"""

from __future__ import annotations

import logging

import tvm
from tvm import te

from souffle_py.ir.program import TEProgram
from souffle_py.ir.exprs import substitute, uses
from souffle_py.ir.graph import map_loads, read_through, sweep, tensor_key, tensor_loads
from te_passes.patterns import conv, in_layout, is_map
from souffle_py.ir.marks import member_of

log = logging.getLogger(__name__)


def lift_1d_convs(program: TEProgram) -> TEProgram:
    """`program` with its 1-D convolution networks over a unit row (module docstring); unchanged when
    it has no 1-D convolution whose weight is a constant."""
    outputs = {t.op for t in program.outputs.values()}
    stages = program.stages
    convs = {op: w for op in stages if op not in outputs and (w := _conv_1d_weight(program, op)) is not None}
    if not convs:
        return program
    lifted = _network(stages, program.consumers(), convs, outputs)
    params, param_tensors = dict(program.params), dict(program.param_tensors)

    def unit_row_weight(weight: te.Tensor) -> te.Tensor:
        name = f"{weight.op.name}_row"
        if name not in param_tensors:
            value = program.params[weight.op.name]
            params[name] = value.reshape(*value.shape[:2], 1, *value.shape[2:])
            param_tensors[name] = te.placeholder(params[name].shape, weight.dtype, name=name)
        return param_tensors[name]

    views: dict[tuple, te.Tensor] = {}

    def rewrite(op, reads):
        if op not in lifted:
            return None
        if op in convs:  # a map outside the network (a model input) read through a unit-row copy
            data = conv(op).data_tensor
            if tensor_key(data) not in reads:
                reads = {**reads, tensor_key(data): views.setdefault(tensor_key(data), _unit_row_view(data))}
        new = _over_unit_row(op, reads, convs.get(op), unit_row_weight)
        return new.op, lambda n, c, w, t=new: t[n, c, 0, w]

    new_of, _ = sweep(stages, rewrite)
    log.info("%d 1-D convolutions and %d other TEs lifted to 2-D maps over one row", len(convs),
             len(lifted) - len(convs))
    return program.rebuilt(new_of, params, param_tensors)


def _conv_1d_weight(program: TEProgram, op) -> te.Tensor | None:
    """The constant blocked weight [F / B, C / g, k, B] of a 1-D convolution TE (a float32 [N, F, W]
    reduction over the product of one 3-D map read and that weight), else None."""
    found = conv(op)
    if (found is None or found.layout != "NCW" or not is_map(op, "NCW") or member_of(op) is not None
            or str(op.output(0).dtype) != "float32"):
        return None
    weight = found.weight_tensor
    if not isinstance(weight.op, te.PlaceholderOp) or program.placeholder_kind(weight) != "param":
        return None
    # the blocked weight (block_conv_weights), read W[f // B, c, r, f % B] at the output channel f (a bf16 GEMM's
    # packed weight [N / P, K / 2, P, 2] has as many axes)
    return weight if found.reads_filter_blocks() else None


def _network(stages, consumers, convs, outputs) -> set:
    """The 1-D convs and the channel-wise 3-D TEs connected to them through channel-wise TEs."""
    producers = {op: {t.op for t in op.input_tensors if isinstance(t.op, te.ComputeOp)} for op in stages}
    network, frontier = set(convs), list(convs)
    while frontier:
        op = frontier.pop()
        for near in producers.get(op, set()) | set(consumers.get(op, [])):
            if near not in network and near not in outputs and _channel_wise(near):
                network.add(near)
                frontier.append(near)
    return network


def _channel_wise(op) -> bool:
    """A float32 [N, C, W] TE outside recurrences that reads every 3-D map at its own channel (shifted by
    a constant at most: a concat along the channels) and along W only at its own columns' positions."""
    if (not is_map(op, "NCW") or op.num_outputs != 1 or member_of(op) is not None
            or str(op.output(0).dtype) != "float32"):
        return False
    n, c, w = (iv.var for iv in op.axis)
    analyzer = tvm.sym.Analyzer()
    for load in tensor_loads(op.body[0]):
        if not in_layout(load, "NCW"):
            continue
        batch, channel, column = load.args[1:]
        if (uses(batch, c) or uses(batch, w) or uses(column, c)
                or not isinstance(analyzer.simplify(channel - c), tvm.tirx.IntImm)):
            return False
    return True


def _unit_row_view(t: te.Tensor):
    """A reader of the [N, C, W] tensor `t` through a [N, C, 1, W] copy of it."""
    batch, channels, width = (int(d) for d in t.shape)
    view = te.compute((batch, channels, 1, width), lambda n, c, h, w: t[n, c, w], name=f"{t.op.name}_row")
    return lambda n, c, w: view[n, c, 0, w]


def _over_unit_row(op, reads, weight, unit_row_weight) -> te.Tensor:
    """`op` computed as [N, C, 1, W], reading the lifted maps through `reads` and, for a 1-D conv, its
    weight `weight` as [F / B, C / g, 1, k, B]."""
    batch, channels, width = (int(iv.dom.extent) for iv in op.axis)
    handles = [iv.var.__chandle__() for iv in op.axis]
    body = map_loads(op.body[0], read_through(reads))
    if weight is not None:
        row_weight = unit_row_weight(weight)
        body = map_loads(body, lambda t, idx: row_weight(idx[0], idx[1], 0, *idx[2:])
                         if tensor_key(t) == tensor_key(weight) else None)

    def lifted(n, c, h, w):
        return substitute(body, dict(zip(handles, (n, c, w))))
    return te.compute((batch, channels, 1, width), lifted, name=op.name, tag=op.tag)
