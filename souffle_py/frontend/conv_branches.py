"""Parallel convolutions of one input whose outputs are summed, folded into one convolution.

Re-parameterizable networks (RepVGG, MobileOne, ACNet/DBB-style blocks) train several branches over the
same input, a 3x3 conv, a 1x1 conv, a batch-norm "identity", and add them. Exported for inference they
still run every branch: MobileOne-s0's blocks are four 1x1 convs plus a scale conv plus a batch norm, one
sum, and souffle-py ran them stacked on a member axis (1.34x ONNX Runtime, which runs them one by one).
Convolution is linear in its weight, so conv(x, W1) + conv(x, W2) = conv(x, W1 + W2) when both read x with
the same strides, dilations and groups and their windows are centred alike (a 1x1 kernel is the centre tap
of a 3x3 one padded by 1); an inference batch norm of x is such a conv with one tap per channel. The fold
is the deploy-time re-parameterization these papers describe, done on the ONNX graph before lowering, for
any Add of two such branches (a chain of Adds folds one branch at a time). Values change only by float
rounding (the products are summed in another order).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Branch:
    """A conv (or an identity batch norm, as a conv) of `source`: weight [F, C / g, *k], bias [F]."""

    node: onnx.NodeProto
    source: str
    weight: np.ndarray
    bias: np.ndarray
    strides: tuple
    dilations: tuple
    group: int
    pads: tuple  # begins then ends


def fold_conv_branches(proto: onnx.ModelProto) -> onnx.ModelProto:
    """`proto` with every Add of two convolution branches of one input, or of a conv and a constant bias,
    folded into one Conv (module docstring); `proto` itself when there is none."""
    graph = proto.graph
    nodes = list(graph.node)
    consts = _constants(graph)
    shapes = {vi.name: tuple(d.dim_value for d in vi.type.tensor_type.shape.dim)
              for vi in list(graph.value_info) + list(graph.output)}
    outputs = [out.name for out in graph.output]
    new_weights: dict[str, np.ndarray] = {}
    folded = 0
    while True:
        uses = _use_counts(nodes, outputs)
        producer = {out: node for node in nodes for out in node.output}
        for at, add in enumerate(nodes):
            if add.op_type != "Add" or len(add.input) != 2:
                continue
            a, b = (_branch(producer.get(name), name, consts, uses) for name in add.input)
            if a is not None and b is None and add.input[1] in consts:  # a bias added apart: conv + b[c]
                merged = _with_bias(a, consts[add.input[1]])
            elif b is not None and a is None and add.input[0] in consts:
                a, merged, b = b, _with_bias(b, consts[add.input[0]]), None
            else:
                shape = shapes.get(add.input[0])  # no broadcast: both known and equal
                same = bool(shape) and all(shape) and shapes.get(add.input[1]) == shape
                merged = _merge(a, b) if a is not None and b is not None and same else None
            if merged is not None:
                break
        else:
            break
        conv, weights = _folded_conv(add, a if a.node.op_type == "Conv" else b, merged)
        consts.update(weights)
        new_weights.update(weights)
        dropped = {n.output[0] for n in (a.node, b.node if b is not None else a.node)}
        nodes = [n for n in nodes[:at] if n.output[0] not in dropped] + [conv] + [
            n for n in nodes[at + 1:] if n.output[0] not in dropped]
        folded += 1
    if not folded:
        return proto
    log.info("%d sums of convolution branches folded into single convolutions", folded)
    new = onnx.ModelProto()
    new.CopyFrom(proto)
    del new.graph.node[:]
    new.graph.node.extend(nodes)
    read = {name for node in nodes for name in node.input}
    kept = [init for init in new.graph.initializer if init.name in read]
    del new.graph.initializer[:]
    new.graph.initializer.extend(kept + [numpy_helper.from_array(v, k) for k, v in new_weights.items() if k in read])
    return new


def _constants(graph) -> dict[str, np.ndarray]:
    """Initializers, Constant outputs and Identity copies of them, by name."""
    consts = {init.name: numpy_helper.to_array(init) for init in graph.initializer}
    for node in graph.node:  # nodes are topologically sorted
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            consts[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
        elif node.op_type == "Identity" and node.input[0] in consts:
            consts[node.output[0]] = consts[node.input[0]]
    return consts


def _use_counts(nodes, outputs) -> dict[str, int]:
    """Readers per value name: node inputs (those of If/Loop/Scan bodies too, which may read outer values)
    and graph outputs."""
    uses: dict[str, int] = {}
    for name in [name for node in nodes for name in _inputs(node)] + list(outputs):
        uses[name] = uses.get(name, 0) + 1
    return uses


def _inputs(node) -> list[str]:
    names = list(node.input)
    for attr in node.attribute:
        for sub in list(attr.g.node if attr.HasField("g") else []) + [n for g in attr.graphs for n in g.node]:
            names += _inputs(sub)
    return names


def _branch(node, name: str, consts, uses) -> _Branch | None:
    """The branch computing `name`, read by one node only: a 2-D Conv with constant float32 weight and
    bias and explicit pads, or an inference BatchNormalization (a one-tap conv of its input)."""
    if node is None or uses.get(name, 0) != 1:
        return None
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if node.op_type == "Conv" and len(node.input) >= 2 and node.input[1] in consts:
        weight = consts[node.input[1]]
        has_bias = len(node.input) > 2 and node.input[2]
        bias = consts.get(node.input[2]) if has_bias else np.zeros(weight.shape[0], weight.dtype)
        if (weight.ndim != 4 or weight.dtype != np.float32 or bias is None
                or attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET")):
            return None
        return _Branch(node, node.input[0], weight, bias, tuple(attrs.get("strides", (1, 1))),
                       tuple(attrs.get("dilations", (1, 1))), int(attrs.get("group", 1)),
                       tuple(attrs.get("pads", (0, 0, 0, 0))))
    if node.op_type == "BatchNormalization" and len(node.output) == 1 and all(i in consts for i in node.input[1:5]):
        gamma, beta, mean, var = (consts[i].astype(np.float64) for i in node.input[1:5])
        if gamma.ndim != 1 or consts[node.input[1]].dtype != np.float32:
            return None
        scale = gamma / np.sqrt(var + float(attrs.get("epsilon", 1e-5)))
        channels = gamma.shape[0]
        return _Branch(node, node.input[0], scale.astype(np.float32).reshape(channels, 1, 1, 1),
                       (beta - mean * scale).astype(np.float32), (1, 1), (1, 1), channels, (0, 0, 0, 0))
    return None


def _merge(a: _Branch, b: _Branch) -> tuple | None:
    """(weight, bias, pads, group) of the one conv computing a + b, or None where they do not align."""
    if a.source != b.source or a.node.op_type == b.node.op_type == "BatchNormalization":
        return None
    if a.node.op_type == "BatchNormalization":
        a, b = b, a  # the conv first: an identity takes its geometry
    if b.node.op_type == "BatchNormalization":
        if a.strides != (1, 1) or a.weight.shape[0] != b.weight.shape[0]:
            return None
        b = _identity_in(a, b)
        if b is None:
            return None
    if ((a.strides, a.dilations, a.group) != (b.strides, b.dilations, b.group)
            or a.weight.shape[:2] != b.weight.shape[:2]):
        return None
    kernel = [max(x, y) for x, y in zip(a.weight.shape[2:], b.weight.shape[2:])]
    weight = np.zeros((*a.weight.shape[:2], *kernel), np.float32)
    pads = None
    for branch in (a, b):
        offsets = [(k - w) // 2 for k, w in zip(kernel, branch.weight.shape[2:])]
        if any((k - w) % 2 for k, w in zip(kernel, branch.weight.shape[2:])):
            return None
        # a smaller kernel, centred, reads from d * offset further in: its pads must be that much smaller
        own = tuple(p + d * o for p, d, o in zip(branch.pads, branch.dilations * 2, offsets * 2))
        if pads is not None and own != pads:
            return None
        pads = own
        kh, kw = branch.weight.shape[2:]
        weight[:, :, offsets[0]:offsets[0] + kh, offsets[1]:offsets[1] + kw] += branch.weight
    return weight, a.bias + b.bias, pads, a.group


def _with_bias(conv: _Branch, value: np.ndarray) -> tuple | None:
    """(weight, bias, pads, group) of `conv` with a constant added to its bias: a scalar or per channel
    ([F], [F, 1, 1] or [1, F, 1, 1]); None for a batch norm or another shape."""
    channels = conv.weight.shape[0]
    if conv.node.op_type != "Conv" or value.dtype != np.float32:
        return None
    if value.size == 1:  # a scalar (MobileOne's exported blocks add one to each branch sum)
        return conv.weight, conv.bias + value.reshape(()), conv.pads, conv.group
    if value.shape not in ((channels,), (channels, 1, 1), (1, channels, 1, 1)):
        return None
    return conv.weight, conv.bias + value.reshape(channels), conv.pads, conv.group


def _identity_in(conv: _Branch, norm: _Branch) -> _Branch | None:
    """The batch norm `norm` of the conv's input as a 1x1 conv of the conv's groups: one tap per output
    channel, on the input channel of the same number (the conv must map C channels to C)."""
    channels = norm.weight.shape[0]
    per_group = conv.weight.shape[1]
    if conv.weight.shape[0] != channels or channels % conv.group or channels // conv.group != per_group:
        return None
    weight = np.zeros((channels, per_group, 1, 1), np.float32)
    weight[np.arange(channels), np.arange(channels) % per_group, 0, 0] = norm.weight[:, 0, 0, 0]
    return _Branch(norm.node, norm.source, weight, norm.bias, conv.strides, conv.dilations, conv.group,
                   (0, 0, 0, 0))


def _folded_conv(add, conv: _Branch, merged) -> tuple[onnx.NodeProto, dict[str, np.ndarray]]:
    """The Conv replacing `add` (its output, `conv`'s input and geometry, the merged weight and bias) and
    its new constants by name."""
    weight, bias, pads, group = merged
    name = add.name or add.output[0]
    w_name, b_name = f"{name}_folded_weight", f"{name}_folded_bias"
    node = helper.make_node("Conv", [conv.source, w_name, b_name], list(add.output), name=f"{name}_folded",
                            kernel_shape=list(weight.shape[2:]), strides=list(conv.strides),
                            dilations=list(conv.dilations), group=group, pads=list(pads))
    return node, {w_name: weight.astype(np.float32), b_name: np.asarray(bias, np.float32).reshape(weight.shape[0])}
