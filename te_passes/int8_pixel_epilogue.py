"""The elementwise reader of a pixel-lane conv's padded sum (te_passes/int8_conv_vnni.py `pixel_lanes`:
[N, F, P] with P the H * W pixels padded up to whole vectors) laid over the padded pixels too.

Why: a reader over [N, F, H, W] covers fewer points than the sum's tiles write, so the conv's write-back
could not compute it (schedule/int8_pixel_conv.py: under the padding's predicate, a schedule made anew lost
the later convs' tiles); it ran as a pass of its own over the int32 sums (ResNet-50's 14 x 14 residual adds,
0.056 ms each, six of them). Here the reader E becomes E' over [N, F, P], reading the sum at p and its
other maps at the clamped pixel min(p, H * W - 1) (the padded points compute a value no reader sees), and
E's readers read E'[n, f, h * W + w]: the write-back computes E' in registers, as for an unpadded map.
"""

from __future__ import annotations

import tvm
from tvm import te, tirx

from souffle_py.ir.exprs import substitute
from souffle_py.ir.graph import map_loads, rebuild_reading, sweep, tensor_key
from souffle_py.ir.program import TEProgram
from te_passes.int8_conv_vnni import PIXEL_LANES


def flat_padded_epilogues(program: TEProgram) -> TEProgram:
    """`program` with each elementwise reader of a padded pixel-lane sum over the padded pixels (module
    docstring); a program output keeps its shape."""
    outputs = {tensor_key(t) for t in program.outputs.values()}

    def rewrite(op, reads):
        current = rebuild_reading(op, reads, {})
        if tensor_key(op.output(0)) in outputs:
            return None
        found = padded_sums_read(current)
        if not found:
            return None
        flat = _over_padded_pixels(current, found)
        width = int(current.output(0).shape[3])
        return flat.op, lambda n, f, h, w: flat[n, f, h * width + w]

    new_of, replaced = sweep(program.stages, rewrite)
    return program.rebuilt(new_of, program.params, program.param_tensors) if replaced else program


def padded_sums_read(op) -> list:
    """The padded pixel-lane sums [N, F, P] (one shape) that the elementwise TE `op` over [N, F, H, W] reads
    at each of its points (sum[n, f, h * W + w], and nowhere else: a residual add reads two), or []."""
    if not isinstance(op, te.ComputeOp) or op.reduce_axis or op.num_outputs != 1 or len(op.axis) != 4:
        return []
    n, f, height, width = (int(d) for d in op.output(0).shape)
    sums = {tensor_key(t): t for t in op.input_tensors if PIXEL_LANES in (t.op.attrs or {}) and len(t.shape) == 3
            and [int(d) for d in t.shape[:2]] == [n, f] and int(t.shape[2]) > height * width}
    if not sums or len({int(t.shape[2]) for t in sums.values()}) != 1:
        return []
    axes = [iv.var for iv in op.axis]
    analyzer = tvm.sym.Analyzer()
    for iv in op.axis:
        analyzer.bind(iv.var, tvm.ir.Range(iv.dom.min, iv.dom.min + iv.dom.extent))
    want = [axes[0], axes[1], axes[2] * width + axes[3]]
    at_point = []

    def check(tensor, indices):
        if tensor_key(tensor) in sums:
            at_point.append(all(analyzer.can_prove_equal(a, b) for a, b in zip(indices, want)))

    map_loads(op.body[0], check)
    return list(sums.values()) if at_point and all(at_point) else []


def _over_padded_pixels(op: te.ComputeOp, sums: list) -> te.Tensor:
    """E' [N, F, P]: `op`'s body with the sums read at p, every other map at the clamped pixel."""
    width = int(op.output(0).shape[3])
    last = int(op.output(0).shape[2]) * width - 1
    axes = [iv.var for iv in op.axis]
    body = op.body[0]
    keys = {tensor_key(t) for t in sums}
    shape = [int(d) for d in sums[0].shape]

    def value(n, f, p):
        at_p = map_loads(body, lambda t, idx: t[n, f, p] if tensor_key(t) in keys else None)
        pixel = tirx.min(p, last)
        clamped = substitute(at_p, {axes[0].__chandle__(): n, axes[1].__chandle__(): f,
                                    axes[2].__chandle__(): pixel // width, axes[3].__chandle__(): pixel % width})
        return map_loads(clamped, lambda t, idx: _unclamped(t, idx, n, f, p, pixel, shape))

    return te.compute([int(d) for d in sums[0].shape], value, name=op.name, tag=op.tag, attrs=op.attrs)


def _unclamped(tensor, indices, n, f, p, pixel, shape):
    """A read of another map over the same padded pixels (the previous block's E', through its reader) at
    the clamped pixel, as a read at p: a vector of whole lanes, where min(p, last) gathered lane by lane."""
    if [int(d) for d in tensor.shape] != shape or len(indices) != 3:
        return None
    analyzer = tvm.sym.Analyzer()
    if not analyzer.can_prove_equal(indices[2], pixel) or not analyzer.can_prove_equal(indices[1], f):
        return None
    return tensor[indices[0], f, p]
