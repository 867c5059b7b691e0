"""Mixed precision for convolutions on the CPU: bfloat16 operands on `vdpbf16ps`, float32 accumulation.

Runs after the CPU's layout passes (backends/cpu.py), on the convolutions in the layouts they chose: a
channel-blocked output [N, F / B, H, W, B] (B a multiple of 16) or an NCHW one [N, F, H, W] (F a multiple
of 16). For each convolution with a constant weight and an even channel reduction of at least
MIN_CHANNELS (dense KxK, 1x1, and grouped ones whose groups hold 16 output channels or more, so that the
16 lanes of one instruction share their input: ResNeXt-101's groups of 16 and 32), the reduction over c
becomes one over channel pairs (cp, p), c = 2 cp + p, innermost p, and

- the weight is converted once, here, to bfloat16 bits packed Wp[F / 16, C / 2, kh, kw, 16, 2]: one
  64-byte row Wp[f // 16, cp, r, s] is the 16 output channels x 2 input channels the instruction reads;
- the input is rounded to bfloat16 by the mechanism the GEMMs use (te_passes/precision.py, `reduced`): in
  the epilogue of the element-wise TE that produces it (a pad with batch norm and ReLU composed in), or by
  a conversion TE in its producer's kernel. In channel blocks two consecutive input channels of a pixel
  are adjacent already (the 32-bit pair the instruction broadcasts); an NCHW input gets a rounded copy
  laid out [.., C / 2, H, W, 2] instead.

Depthwise convolutions (no reduction over channels to pair), groups of fewer than 16 output channels
(lanes that read different inputs) and odd or few channels stay float32, logged with the reason.
The schedule is schedule/bf16_conv.py.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import numpy as np
import tvm
import tvm_ffi
from tvm import te, tirx

from souffle_py.ir.program import TEProgram
from souffle_py.ir.exprs import simplify_reads, substitute
from te_passes.patterns import LAYOUT_RANKS, is_map, product_reduction
from te_passes.precision import LANES, PAIR, PackedBits, bf16_bits, reduced, widen
from souffle_py.ir.marks import member_of

log = logging.getLogger(__name__)

BF16_CONV = "souffle_bf16_conv"  # TE attribute (a block annotation once merged): lanes per instruction
MIN_CHANNELS = 8                 # fewer input channels (an RGB stem's 3) stay float32
MIN_PIXELS = 4                   # fewer output points (a squeeze-excite conv over a 1 x 1 map) is a GEMV


def reduce_conv_precision(program: TEProgram) -> TEProgram:
    """`program` with its convolutions of constant weights on bfloat16 operands (module docstring); the
    others unchanged, each logged with why."""
    copies: dict = {}
    candidates = {}
    for op in program.stages:
        try:  # an index form this pass does not foresee leaves the conv float32, not the compile broken
            found, why = conv_operands(program, op, copies)
            if found is not None:  # its weight reads stay inside the constant
                _dense_weight(op, found.weight_read, program.params[found.weight.op.name])
        except (IndexError, KeyError, ValueError, TypeError, RuntimeError) as exc:  # RuntimeError: TVM's
            found, why = None, f"not understood ({type(exc).__name__}: {exc})"
        if found is not None:
            candidates[op] = found
        elif why:
            log.info("%s stays float32: %s", op.name, why)
    return reduced(program, PackedBits(), candidates, "convolutions")


@dataclass(frozen=True)
class ConvOperands:
    """A convolution's converted operands and the facts its rewrite needs (found by `conv_operands`)."""

    op: te.ComputeOp
    weight: te.Tensor
    weight_read: tvm.ir.Call  # the weight's read, its layout
    data: tvm.ir.Call        # the input read
    channel: tirx.Var        # the reduction over input channels (its extent even)
    in_place_read: bool      # the input's two consecutive channels adjacent as stored
    position: int            # else the index of the input's channel axis (for the paired copy)
    copies: dict = field(compare=False, hash=False)  # paired copies shared by the convolutions of one pass

    @property
    def activations(self) -> list:
        return [self.data]

    @property
    def weight_key(self):
        """Each convolution packs its own copy: two convolutions may read one weight in different layouts."""
        return (self.weight.op.name, self.op.name)

    def stored_weight(self, values: np.ndarray, enc) -> np.ndarray:
        """W[f, c, taps] evaluated from the weight's own layout and packed [F / 16, C / 2, *taps, 16, 2]."""
        dense = _dense_weight(self.op, self.weight_read, values)
        f, c, *taps = dense.shape
        bits = bf16_bits(dense).reshape(f // LANES, LANES, c // PAIR, PAIR, *taps)
        order = (0, 2, *range(4, 4 + len(taps)), 1, 3)
        return np.ascontiguousarray(bits.transpose(order))

    def in_place(self, op, load, enc) -> bool:
        return self.in_place_read

    def copy(self, op, load, source, enc):
        """A rounded copy of `source` with its channel axis split in pairs, [.., C / 2, .., 2], shared by
        every convolution of the pass that reads `source` so, and how a read of `source` reads it."""
        pos = self.position
        key = (source.op, pos)
        if key not in self.copies:
            shape = [int(d) for d in source.shape]
            paired = shape[:pos] + [shape[pos] // PAIR] + shape[pos + 1:] + [PAIR]

            def value(*i):
                return enc.round(source(*i[:pos], i[pos] * PAIR + i[-1], *i[pos + 1:-1]))
            self.copies[key] = te.compute(paired, value, name=f"{source.op.name}_pairs{enc.suffix()}")
        copy = self.copies[key]
        return lambda *i: copy(*i[:pos], i[pos] // PAIR, *i[pos + 1:], i[pos] % PAIR)

    def rewrite(self, current, stored, reads, enc) -> te.ComputeOp:
        """The convolution over channel pairs: sum over (cp, taps, p) of widen(X) * widen(Wp) (the
        operands in the order the tensor intrinsic describes them, schedule/bf16_gemm.py)."""
        op, reduce = self.op, list(self.op.reduce_axis)
        channels = int(next(r for r in reduce if r.var.same_as(self.channel)).dom.extent)
        cp = te.reduce_axis((0, channels // PAIR), name="cp")
        taps = [te.reduce_axis((0, int(r.dom.extent)), name=r.var.name) for r in reduce if not r.var.same_as(self.channel)]
        p = te.reduce_axis((0, PAIR), name="p")
        old_taps = [r.var for r in reduce if not r.var.same_as(self.channel)]
        (read,) = reads.values()  # the input, rounded: in place, converted or a paired copy
        shape = [int(d) for d in op.output(0).shape]

        def body(*axes):
            mapping = {iv.var.__chandle__(): a for iv, a in zip(op.axis, axes)}
            mapping.update({v.__chandle__(): t.var for v, t in zip(old_taps, taps)})
            mapping[self.channel.__chandle__()] = cp.var * PAIR + p.var
            x = read(*[substitute(i, mapping) for i in self.data.args[1:]])
            f = _output_channel(axes, shape)
            w = stored[f // LANES, cp.var, *[t.var for t in taps], f % LANES, p.var]
            bounds = {a: e for a, e in zip(axes, shape)}
            bounds.update({cp.var: channels // PAIR, p.var: PAIR, **{t.var: int(t.dom.extent) for t in taps}})
            product = simplify_reads(widen(x) * widen(w), bounds)
            return te.sum(product, axis=[cp, *taps, p])
        attrs = {**(op.attrs or {}), BF16_CONV: LANES}
        return te.compute(shape, body, name=op.name, tag=op.tag, attrs=attrs).op


def conv_operands(program: TEProgram, op, copies: dict):
    """(ConvOperands, "") for a convolution the bf16 policy converts; (None, why) for one it leaves
    float32 (why empty when `op` is no convolution at all)."""
    product = product_reduction(op)
    if (product is None or op.num_outputs != 1 or not (is_map(op, "NCHW") or is_map(op, "NCHWc"))
            or member_of(op) is not None or str(op.output(0).dtype) != "float32" or len(op.reduce_axis) < 2):
        return None, ""
    loads = product.loads
    if len(loads) != 2 or not all(isinstance(x, tvm.ir.Call) for x in (product.a, product.b)):
        return None, ""
    weights = [ld for ld in loads if isinstance(ld.args[0].op, te.PlaceholderOp)
               and program.placeholder_kind(ld.args[0]) == "param"]
    if not all(str(ld.args[0].dtype) == "float32" for ld in loads) or len(weights) > 1:
        return None, ""
    if not weights:
        return None, "its weight is computed, not a constant (a squeeze-excite gate folded into it)"
    weight = weights[0]
    data = next(ld for ld in loads if ld is not weight)
    shape = [int(d) for d in op.output(0).shape]
    channel = op.reduce_axis[0]
    channels = int(channel.dom.extent)
    blocked = is_map(op, "NCHWc")  # an output stored in channel blocks: [N, F / b, H, W, b]
    lanes_axis = op.axis[4] if blocked else op.axis[1]
    allowed = {lanes_axis.var.__chandle__(), op.axis[1].var.__chandle__(),
               *[r.var.__chandle__() for r in op.reduce_axis]}
    if channels == 1:
        return None, "a depthwise convolution has no reduction over channels to pair"
    if channels % PAIR or channels < MIN_CHANNELS:
        return None, f"{channels} input channels per output (odd or fewer than {MIN_CHANNELS})"
    if int(lanes_axis.dom.extent) % LANES:
        return None, f"{int(lanes_axis.dom.extent)} output channels per block, not a multiple of {LANES}"
    if math.prod(shape) // (int(op.axis[1].dom.extent) * (shape[4] if blocked else 1)) < MIN_PIXELS:
        return None, f"fewer than {MIN_PIXELS} output points (a GEMV)"
    if not all(_vars(i) <= allowed for i in weight.args[1:]) or not _evaluable(weight.args[1:]):
        return None, "its weight's indices are not a function of the output channel and the taps"
    if not any(channel.var.__chandle__() in _vars(i) for i in data.args[1:]):
        return None, "its input does not depend on the channel reduction"
    # the input's indices with the output channels in vectors of LANES lanes and the channels in pairs
    vector, lane, pair, pair_p = (tirx.Var(name, "int32") for name in ("vector", "lane", "cp", "p"))
    split = {lanes_axis.var.__chandle__(): vector * LANES + lane}
    paired = {channel.var.__chandle__(): pair * PAIR + pair_p}
    bounds = {**{iv.var: int(iv.dom.extent) for iv in op.axis}, **{r.var: int(r.dom.extent) for r in op.reduce_axis},
              vector: int(lanes_axis.dom.extent) // LANES, lane: LANES, pair: channels // PAIR, pair_p: PAIR}
    analyzer = tvm.sym.Analyzer()
    for var, extent in bounds.items():
        analyzer.bind(var, tvm.ir.Range(0, extent))
    indices = [analyzer.simplify(substitute(substitute(i, split), paired)) for i in data.args[1:]]
    if any(lane.__chandle__() in _vars(i) for i in indices):
        return None, (f"its {LANES} output lanes read different inputs (groups of fewer than {LANES} output "
                      "channels)")
    uses_p = [pair_p.__chandle__() in _vars(i) for i in indices]
    step = analyzer.simplify(substitute(indices[-1], {pair_p.__chandle__(): tirx.IntImm("int32", 1)})
                             - substitute(indices[-1], {pair_p.__chandle__(): tirx.IntImm("int32", 0)}))
    in_place = uses_p[-1] and not any(uses_p[:-1]) and isinstance(step, tirx.IntImm) and int(step) == 1
    uses_c = [channel.var.__chandle__() in _vars(i) for i in data.args[1:]]
    position = uses_c.index(True) if sum(uses_c) == 1 else -1
    if not in_place and (position < 0 or int(data.args[0].shape[position]) % PAIR):
        return None, "its input's channels cannot be read in adjacent pairs"
    return ConvOperands(op, weight.args[0], weight, data, channel.var, in_place, position, copies), ""


def _output_channel(axes, shape):
    """The output channel f of a point: fb * B + fi over channel blocks, f over NCHW."""
    return axes[1] * shape[4] + axes[4] if len(shape) == LAYOUT_RANKS["NCHWc"] else axes[1]


def _dense_weight(op, weight_load, values: np.ndarray) -> np.ndarray:
    """W[f, c, *taps] (float32) read from the weight constant `values` as `op` reads it."""
    shape = [int(d) for d in op.output(0).shape]
    reduce = list(op.reduce_axis)
    blocked = is_map(op, "NCHWc")
    filters = shape[1] * shape[4] if blocked else shape[1]
    extents = [filters] + [int(r.dom.extent) for r in reduce]
    grid = np.meshgrid(*[np.arange(e) for e in extents], indexing="ij")
    f = grid[0]
    env = {r.var.__chandle__(): g for r, g in zip(reduce, grid[1:])}
    if blocked:
        env[op.axis[1].var.__chandle__()] = f // shape[4]
        env[op.axis[4].var.__chandle__()] = f % shape[4]
    else:
        env[op.axis[1].var.__chandle__()] = f
    index = tuple(np.broadcast_to(_evaluate(i, env), f.shape) for i in weight_load.args[1:])
    return np.ascontiguousarray(values[index], dtype=np.float32)


_BINARY = {tirx.Add: np.add, tirx.Sub: np.subtract, tirx.Mul: np.multiply,
           tirx.FloorDiv: np.floor_divide, tirx.FloorMod: np.mod}


def _evaluate(expr, env):
    """An integer index expression over numpy arrays (`env`: variable handle -> values)."""
    if isinstance(expr, tirx.IntImm):
        return int(expr.value)
    if isinstance(expr, tvm.ir.Var):
        return env[expr.__chandle__()]
    if type(expr) not in _BINARY:
        raise KeyError(type(expr).__name__)
    return _BINARY[type(expr)](_evaluate(expr.a, env), _evaluate(expr.b, env))


def _evaluable(indices) -> bool:
    """Whether `_evaluate` knows every node of the indices (+, -, *, floordiv, floormod of variables and
    integers)."""
    zeros = _Zeros()
    try:
        for i in indices:
            _evaluate(i, zeros)
    except (KeyError, ZeroDivisionError):
        return False
    return True


class _Zeros(dict):
    def __missing__(self, key):
        return 0


def _vars(expr) -> set:
    """The handles of the variables `expr` uses."""
    found = []
    tvm_ffi.structural_walk(expr, [(tvm.ir.Var, found.append)])
    return {v.__chandle__() for v in found}
