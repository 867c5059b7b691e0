"""Convolution weights blocked over output channels: the layout pass that turns the frontend's ONNX weight
W[F, C / g, *k] into [F / B, C / g, *k, B], read W[f // B, c, *r, f % B] (te_passes/patterns/conv.py).

Output channels are then contiguous, so a vector over them is a plain load, and each block of B filters is
one contiguous stream (the ONNX layout puts consecutive filters C / g * k values apart; a channels-last one
puts consecutive reduction steps thousands of bytes apart, which thrashes the L1 cache's sets). B is the
first of the target's `blocks` dividing F, else F (one block). Every layout pass and schedule rule after it
matches the blocked form. A constant weight becomes a new parameter `{weight}_blocked` in the place of the
plain one (shared by every convolution reading it); a computed weight is read through a blocking TE.
"""

from __future__ import annotations

import numpy as np
from tvm import te

from souffle_py.frontend.context import sanitize
from souffle_py.ir.program import TEProgram
from souffle_py.ir.graph import map_loads, sweep, tensor_key
from te_passes.patterns import plain_conv


class _Blocked:
    def __init__(self):
        self.blocks: list[tuple[str, int]] = []  # (weight, B) per blocked weight

    def summary(self) -> str:
        if not self.blocks:
            return "unchanged"
        shown = ", ".join(f"{name} by {block}" for name, block in self.blocks[:4])
        return f"{len(self.blocks)} conv weight(s) blocked: {shown}" + (" ..." if len(self.blocks) > 4 else "")


def block_of(filters: int, blocks) -> int:
    """Output channels per block of a weight with `filters` output channels: the first of `blocks` dividing
    it, else all of them."""
    return next((b for b in blocks if filters % b == 0), filters)


def blocked_array(weight: np.ndarray, block: int) -> np.ndarray:
    """[F, C / g, *k] as [F / block, C / g, *k, block]."""
    filters, *rest = weight.shape
    blocked = weight.reshape(filters // block, block, *rest).transpose(0, *range(2, weight.ndim + 1), 1)
    return np.ascontiguousarray(blocked)


def block_conv_weights(program: TEProgram, blocks) -> tuple[TEProgram, _Blocked]:
    """`program` with every frontend convolution (patterns.plain_conv) reading its weight blocked by the
    first of `blocks` dividing its output channels (module docstring)."""
    done = _Blocked()
    taken = {op.name for op in program.stages} | set(program.params) | {t.op.name for t in program.inputs.values()}
    derived: dict[str, list] = {}  # plain parameter -> its blocked parameters (name, array, placeholder)
    made: dict[tuple, te.Tensor] = {}  # (weight key, B) -> blocked tensor
    renamed: list[str] = []  # convs named anew (_name)

    def unique(base: str) -> str:
        name, n = base, 1
        while name in taken:
            name, n = f"{base}_{n}", n + 1
        taken.add(name)
        return name

    def blocked_tensor(op, weight: te.Tensor, source, block: int) -> te.Tensor:
        key = (tensor_key(weight), block)
        if key not in made:
            name = weight.op.name
            if isinstance(weight.op, te.PlaceholderOp) and program.placeholder_kind(weight) == "param":
                array = blocked_array(program.params[name], block)
                new_name = unique(f"{name}_blocked")
                made[key] = te.placeholder(array.shape, str(array.dtype), name=new_name)
                derived.setdefault(name, []).append((new_name, array, made[key]))
            else:  # a computed weight (a dequantized one, int8_conv.py; a graph input): blocked as it is read,
                # named after the conv's ONNX node as the frontend named the copy it made before this pass
                shape = [int(d) for d in weight.shape]
                node = program.origins.get(op.name)
                made[key] = te.compute((shape[0] // block, *shape[1:], block),
                                       lambda fo, *idx: source(fo * block + idx[-1], *idx[:-1]),
                                       name=unique(sanitize(f"{node or op.name}_weight_blocks")))
            done.blocks.append((name, block))
        return made[key]

    def rewrite(op, reads):
        found = plain_conv(op)
        if found is None:
            return None
        weight = found.weight_tensor
        block = block_of(found.filters, blocks)
        wide = blocked_tensor(op, weight, reads.get(tensor_key(weight), weight), block)

        def read(tensor, indices):
            if tensor_key(tensor) == tensor_key(weight):
                f, *rest = indices
                return wide(f // block, *rest, f % block)
            new = reads.get(tensor_key(tensor))
            return None if new is None else new(*indices)

        body = [map_loads(b, read) for b in op.body]
        return te.ComputeOp(_name(op, weight), op.tag, op.attrs, op.axis, op.reduce_axis, body)

    def _name(op, weight) -> str:
        """The conv's name; "{node}_conv" where it was its node's only TE and now reads a blocking TE (the
        frontend named a node's TEs "{node}_{te}" when it made several, and it made the blocking TE)."""
        node = program.origins.get(op.name)
        if node is None or weight.op.name in program.params or op.name != sanitize(node):
            return op.name
        renamed.append(op.name)
        return unique(sanitize(f"{node}_conv"))

    new_of, replaced = sweep(program.stages, rewrite)
    if not replaced:
        return program, done
    rebuilt = program.rebuilt(new_of)
    rebuilt = rebuilt.replace(origins={k: v for k, v in rebuilt.origins.items() if k not in renamed})
    read = {t.op.name for op in rebuilt.stages for t in op.input_tensors}
    params, param_tensors = {}, {}
    for name, value in program.params.items():
        if name in read or name not in derived:  # a weight no longer read goes; other parameters stay
            params[name], param_tensors[name] = value, program.param_tensors[name]
        for new_name, array, tensor in derived.get(name, ()):
            params[new_name], param_tensors[new_name] = array, tensor
    return rebuilt.replace(params=params, param_tensors=param_tensors), done
