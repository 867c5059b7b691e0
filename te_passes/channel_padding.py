"""Channel counts padded up to the vector block, for the channel-blocked layouts (CPU backend).

A map of C channels stored in blocks of b, [N, ceil(C / b), H, W, b], has a last block whose lanes past
C are padding (oneDNN's and XNNPACK's blocked layouts pad the same way). A TE computed in blocks then runs
its body at channels c >= C too, and every read there must stay inside its buffer:
- reads of other blocked maps are inside their own padded blocks;
- a convolution's constant weight [F / w, C', kh, kw, w] is re-blocked as [ceil(F / b), C', kh, kw, b]
  with zero filters past F (`padded_weight`), so the padded output channels are exact zeros;
- a per-channel constant (a bias, a batch norm's scale and shift: [C] or [1, C, 1, 1]) is zero-padded to
  ceil(C / b) * b channels;
- any other read at the channel (a computed squeeze-excite gate, a model input) is clamped to the last
  channel: inside the buffer, and its value lands only in padding lanes.
Values in the padding lanes are never read by what is computed from the real channels: convolutions
reduce over their C real input channels, pools reduce one channel each, and readers outside the blocks
read channels below C. So `padded_body` changes no real output, only what the padding lanes hold.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import te

from souffle_py.ir.exprs import uses
from souffle_py.ir.graph import map_loads, tensor_key
from te_passes.patterns import conv2d


def padded_size(channels: int, block: int) -> int:
    return -(-channels // block) * block


class ChannelPadding:
    """The zero-padded constants a program's blocked TEs read (new params, shared between readers)."""

    def __init__(self, program):
        self.program = program
        self.params = dict(program.params)
        self.param_tensors = dict(program.param_tensors)

    def _param(self, name: str, value: np.ndarray) -> te.Tensor:
        if name not in self.param_tensors:
            self.params[name] = np.ascontiguousarray(value)
            self.param_tensors[name] = te.placeholder(value.shape, str(value.dtype), name=name)
        return self.param_tensors[name]

    def is_param(self, tensor: te.Tensor) -> bool:
        return isinstance(tensor.op, te.PlaceholderOp) and self.program.placeholder_kind(tensor) == "param"

    def padded_weight(self, weight: te.Tensor, block: int, stacked: bool = False) -> te.Tensor:
        """A constant conv weight [F / w, C', *k, w] as [ceil(F / block), C', *k, block], zero past F; with
        `stacked`, each branch of a weight [B, F / w, C', *k, w] so."""
        value = self.params[weight.op.name]
        padded = np.stack([_padded_filters(v, block) for v in value]) if stacked else _padded_filters(value, block)
        return self._param(f"{weight.op.name}_p{block}", padded)

    def padded_channel_param(self, tensor: te.Tensor, axis: int, block: int) -> te.Tensor:
        """A per-channel constant zero-padded along `axis` to a multiple of `block`."""
        value = self.params[tensor.op.name]
        width = [(0, 0)] * value.ndim
        width[axis] = (0, padded_size(value.shape[axis], block) - value.shape[axis])
        return self._param(f"{tensor.op.name}_p{block}", np.pad(value, width))


def _padded_filters(value: np.ndarray, block: int) -> np.ndarray:
    """A conv weight [F / w, C', *k, w] as [ceil(F / block), C', *k, block], zero past F."""
    plain = np.moveaxis(value, -1, 1).reshape(-1, *value.shape[1:-1])  # [F, C', *k]
    filters = plain.shape[0]
    padded = np.zeros((padded_size(filters, block), *plain.shape[1:]), value.dtype)
    padded[:filters] = plain
    return np.moveaxis(padded.reshape(-1, block, *plain.shape[1:]), 1, -1)


def padded_body(op: te.ComputeOp, body, padding: ChannelPadding, block: int, blocked_keys):
    """`op`'s body (over its own axes, channel op.axis[1]) safe to evaluate at channels past its C:
    reads of tensors not in `blocked_keys` (tensor keys of maps stored in padded blocks) padded or clamped
    as the module docstring says. A convolution's weight read W[fo, .., fi] becomes
    Wp[(fo * w + fi) // block, .., (fo * w + fi) % block]."""
    channel = op.axis[1].var
    simplify = tvm.sym.Analyzer().canonical_simplify
    found = conv2d(op)
    weight = None if found is None else found.weight_tensor

    def rewrite(tensor, indices):
        if tensor_key(tensor) in blocked_keys:
            return None
        if weight is not None and tensor_key(tensor) == tensor_key(weight) and padding.is_param(tensor):
            f = simplify(indices[0] * int(tensor.shape[-1]) + indices[-1])
            wp = padding.padded_weight(tensor, block)
            return wp[(simplify(f // block), *indices[1:-1], simplify(f % block))]
        axes = [i for i, index in enumerate(indices) if uses(index, channel)]
        if len(axes) != 1:
            return None
        axis = axes[0]
        extent = int(tensor.shape[axis])
        if padding.is_param(tensor) and indices[axis].same_as(channel):
            return padding.padded_channel_param(tensor, axis, block)(*indices)
        clamped = list(indices)
        clamped[axis] = tvm.tirx.min(indices[axis], extent - 1)
        return tensor(*clamped)
    return map_loads(body, rewrite)

