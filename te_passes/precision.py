"""Mixed precision: the GEMMs of a program read bfloat16 (or float16) operands and accumulate in float32.

The policy is the usual one (PyTorch autocast, OpenVINO's bf16 inference): the two operands of a GEMM with
a constant weight are rounded to bfloat16 (8-bit mantissa, float32's exponent range), the products are
summed in float32, and everything else (softmax, normalizations, reductions, element-wise math, a
recurrence's state and its per-step GEMVs) stays float32.

- Weights are converted once, here, at compile time, and stored packed in K-pairs: W[K, N] becomes
  Wp[N / L, K / 2, L, 2] (L = LANES), so that one 64-byte row Wp[jb, kp] is exactly the register that the
  CPU's `vdpbf16ps` reads (L columns, each a pair of consecutive k) (schedule/bf16_gemm.py).
- Activations are converted by the TE that produces them: an element-wise producer read only by such
  GEMMs writes bfloat16 itself (its epilogue, no extra pass over memory); any other operand gets a
  conversion TE of its own, which the partitioner places in the kernel of its producer. That mechanism,
  `reduced`, serves the CPU's convolutions too (te_passes/precision_conv.py, run after the layout passes).

How a converted operand is stored is the target's `Encoding`:
- `PackedBits` (the CPU, bf16 only): bfloat16 values stored as their raw bits in uint16 tensors and widened
  with a shift: TVM 0.27 lowers the bfloat16 type to float32 arithmetic on LLVM (BF16ComputeLegalize), and
  its LLVM code generator cannot emit the `bfloat` vectors the instruction takes; the bits are handed to it
  by the micro-kernel (schedule/bf16_gemm.py). Weights packed in K-pairs (above).
- `Native` (GPUs): real float16 / bfloat16 tensors, weights in their own W[K, N] layout; the tensor-core
  schedules (backends/cuda/tensor_cores.py) stage them through shared memory themselves. Both operands
  of a batch matmul of activations (attention's Q.K^T and P.V) are converted too: tensor cores take them
  as they take weights.
Rounding is to nearest, ties to even, as the hardware converts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import tvm
import tvm_ffi
from tvm import te, tirx

from souffle_py.ir.program import TEProgram
from souffle_py.ir.exprs import substitute
from souffle_py.ir.graph import map_loads, rebuild_reading, tensor_key
from te_passes.layout import fresh_name
from te_passes.patterns import product_reduction
from souffle_py.ir.marks import BF16_GEMM, REDUCED_GEMM, member_of

log = logging.getLogger(__name__)

PRECISIONS = ("fp32", "bf16", "fp16")
LANES = 16        # float32 accumulators per vector register (AVX-512): the packed panel's width
PAIR = 2          # bfloat16 products per float32 lane that one vdpbf16ps sums
MIN_ROWS = 4      # fewer rows is a GEMV (a recurrence step's, a classifier's): memory-bound, left float32
STORAGE = "uint16"                # bfloat16 bits
# The accuracy bound of the bf16 policy, relative to the output's largest magnitude: bfloat16 keeps 8
# significant bits, so an operand's rounding error is at most u = 2^-8 and a product's 2u; a few GEMMs in a
# row between normalizations, with terms of mixed sign, stay within 8u (tests/test_precision.py).
BF16_TOLERANCE = 8 * 2.0 ** -8


def to_bf16_bits(value):
    """A float32 expression rounded to bfloat16 (nearest, ties to even), as its 16 bits."""
    bits = tirx.reinterpret("uint32", value)
    lsb = tirx.bitwise_and(tirx.shift_right(bits, tirx.const(16, "uint32")), tirx.const(1, "uint32"))
    rounded = bits + tirx.const(0x7FFF, "uint32") + lsb
    return tirx.shift_right(rounded, tirx.const(16, "uint32")).astype(STORAGE)


def widen(bits):
    """bfloat16 bits as the float32 value they stand for (exact)."""
    return tirx.reinterpret("float32", tirx.shift_left(bits.astype("uint32"), tirx.const(16, "uint32")))


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (nearest, ties to even), as uint16 bits; NaN stays NaN."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(values), np.uint16(0x7FC0), rounded)


def bf16_values(bits: np.ndarray) -> np.ndarray:
    """uint16 bfloat16 bits as float32 values."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def pack_pairs(weight: np.ndarray, lanes: int = LANES) -> np.ndarray:
    """W[K, N] (float32) as bfloat16 bits packed [N / lanes, K / 2, lanes, 2]: Wp[jb, kp, l, p] = W[2 kp + p,
    jb * lanes + l], one vdpbf16ps operand per (jb, kp)."""
    k, n = weight.shape
    return np.ascontiguousarray(bf16_bits(weight).reshape(k // PAIR, PAIR, n // lanes, lanes).transpose(2, 0, 3, 1))


@dataclass(frozen=True)
class PackedBits:
    """The CPU's encoding (bf16 only): bfloat16 bits in uint16 tensors, weights packed
    [N / lanes, K / 2, lanes, 2] for vdpbf16ps, activations read with consecutive k adjacent."""

    lanes: int = LANES
    precision = "bf16"
    storage = STORAGE
    min_rows = MIN_ROWS
    rows_by_k = True          # vdpbf16ps reads k-pairs: an activation read through a transpose gets a copy
    both_activations = False  # a batch matmul of two activations stays float32

    def round(self, value):
        return to_bf16_bits(value)

    def fits(self, weight, indices, k, j) -> bool:
        if len(indices) != 2 or not (indices[0].same_as(k) and indices[1].same_as(j)):
            return False
        depth, n = (int(d) for d in weight.shape)
        return n % self.lanes == 0 and depth % PAIR == 0

    def weight(self, values: np.ndarray) -> np.ndarray:
        return pack_pairs(values, self.lanes)

    def read_weight(self, stored, indices):
        kk, j = indices
        return widen(stored[j // self.lanes, kk // PAIR, j % self.lanes, kk % PAIR])

    def widen(self, value):
        return widen(value)

    def annotation(self) -> dict:
        return {BF16_GEMM: self.lanes}

    def suffix(self) -> str:
        return f"_bf16p{self.lanes}"


@dataclass(frozen=True)
class Native:
    """A GPU's encoding: real float16 / bfloat16 tensors in the layout of the values they round, weights
    too (numpy has no bfloat16: bf16 weights are kept as their uint16 bits, which the runtime uploads into
    a bfloat16 tensor). Both operands of a batch matmul of activations are converted; fewer than 16 rows
    (a GEMV: no tensor-core fragment, memory-bound) stay float32."""

    precision: str
    min_rows = 16
    rows_by_k = False
    both_activations = True

    @property
    def storage(self) -> str:
        return {"fp16": "float16", "bf16": "bfloat16"}[self.precision]

    def round(self, value):
        return value.astype(self.storage)

    def fits(self, weight, indices, k, j) -> bool:
        return True

    def weight(self, values: np.ndarray) -> np.ndarray:
        return bf16_bits(values) if self.precision == "bf16" else np.asarray(values, np.float16)

    def read_weight(self, stored, indices):
        return stored(*indices).astype("float32")

    def widen(self, value):
        return value.astype("float32")

    def annotation(self) -> dict:
        return {REDUCED_GEMM: self.storage}

    def suffix(self) -> str:
        return f"_{self.precision}"


def reduce_precision(program: TEProgram, precision: str, encoding=None) -> TEProgram:
    """`program` under the mixed-precision policy `precision` ("fp32": unchanged; else see the module
    docstring), its converted operands stored as `encoding` says (default: the CPU's PackedBits). The
    caller (a backend) checks that its hardware serves the precision."""
    if precision == "fp32":
        return program
    encoding = encoding or (PackedBits() if precision == "bf16" else None)
    if encoding is None or encoding.precision != precision:
        raise ValueError(f"reduce_precision: no TE rewrite for precision {precision!r} with {encoding}")
    return _reduced_gemms(program, encoding)


def _reduced_gemms(program: TEProgram, enc) -> TEProgram:
    candidates = {op: GemmOperands(*found) for op in program.stages
                  if (found := _operands(program, op, enc)) is not None}
    return reduced(program, enc, candidates, "GEMMs")


@dataclass(frozen=True)
class GemmOperands:
    """A GEMM TE's converted operands (`_operands`): its constant weight W[k, j] (or None: a batch matmul of
    activations) and its activation reads; what `reduced` asks of every kind of converted TE."""

    weight: te.Tensor | None
    activations: list

    @property
    def weight_key(self):
        """The GEMMs reading one weight share its stored copy: they all read it W[k, j]."""
        return None if self.weight is None else self.weight.op.name

    def stored_weight(self, values: np.ndarray, enc) -> np.ndarray:
        return enc.weight(values)

    def in_place(self, op, load, enc) -> bool:
        """Whether the activation is read as it is stored (else through a rounded copy)."""
        return not enc.rows_by_k or _reads_rows_by_k(op, load)

    def copy(self, op, load, source, enc):
        """A rounded [rows, K] copy of an activation read through a transpose, and how `op` reads it."""
        copy = _row_major_copy(op, load, source, enc)
        return lambda *_: copy(*[iv.var for iv in op.axis[:-1]], op.reduce_axis[0].var)

    def rewrite(self, op, stored, reads, enc) -> te.ComputeOp:
        return _reading_reduced(op, self.weight, stored, reads, enc)


def reduced(program: TEProgram, enc, candidates: dict, what: str) -> TEProgram:
    """`program` with each TE of `candidates` (op -> its operands: GemmOperands, or a conv's,
    te_passes/precision_conv.py) reading reduced operands: its weight converted once (`stored_weight`), each
    activation rounded by its producer's epilogue where every reader reads it in place, else by a
    conversion TE (shared by its readers), or by a rounded copy where a reader needs another layout."""
    if not candidates:
        return program
    readers = program.consumers()
    outputs = {tensor_key(t) for t in program.outputs.values()}
    params, param_tensors = dict(program.params), dict(program.param_tensors)
    stored: dict[str, te.Tensor] = {}
    converted: dict[tuple, te.Tensor] = {}  # activation tensor key -> its reduced tensor
    new_of: dict[tuple, te.Tensor] = {}
    in_epilogue = 0
    for op in program.stages:
        current = rebuild_reading(op, new_of, {})
        if op in candidates:
            found = candidates[op]
            weight, weight_key = found.weight, found.weight_key
            if weight is not None and weight_key not in stored:
                name = fresh_name(f"{weight.op.name}{enc.suffix()}", params)
                params[name] = found.stored_weight(program.params[weight.op.name], enc)
                param_tensors[name] = stored[weight_key] = te.placeholder(params[name].shape, enc.storage,
                                                                          name=name)
            reads = {}  # the rebuilt activation's op -> how the TE reads its reduced values
            for activation in found.activations:
                key = tensor_key(activation.args[0])
                source = new_of.get(key, activation.args[0])
                if found.in_place(op, activation, enc):
                    if key not in converted:
                        converted[key] = _converted(source, enc)
                    reads[source.op] = converted[key]
                else:
                    reads[source.op] = found.copy(op, activation, source, enc)
            current = found.rewrite(current, stored.get(weight_key), reads, enc)
            new_of[tensor_key(op.output(0))] = current.output(0)
        elif current is not op:
            for i in range(op.num_outputs):
                new_of[tensor_key(op.output(i))] = current.output(i)
        # an element-wise producer read only by converted TEs, in place, writes the reduced type itself
        key = tensor_key(op.output(0))
        if (op.num_outputs == 1 and not op.reduce_axis and key not in outputs and member_of(op) is None
                and str(op.output(0).dtype) == "float32" and readers.get(op)
                and all(_reads_reduced(r, op, candidates, enc) for r in readers[op])):
            body = current.body[0]
            epilogue = te.ComputeOp(f"{op.name}{enc.suffix()}", op.tag, op.attrs, current.axis, [],
                                    [enc.round(body)])
            converted[key] = epilogue.output(0)
            in_epilogue += 1
    log.info("%s: %d %s read %s operands (%d weights converted, %d activations converted in their "
             "producer's epilogue)", enc.precision, len(candidates), what, enc.precision, len(stored), in_epilogue)
    return program.rebuilt(new_of, params, param_tensors)


def _converted(source: te.Tensor, enc) -> te.Tensor:
    """A conversion TE of `source` (the partitioner places it in its producer's kernel)."""
    return te.compute(source.shape, lambda *i: enc.round(source(*i)), name=f"{source.op.name}{enc.suffix()}")


def _reads_reduced(reader, op, candidates, enc) -> bool:
    """Whether `reader` is a converted TE that reads `op` only as a converted activation, in place."""
    if reader not in candidates:
        return False
    loads = [a for a in candidates[reader].activations if a.args[0].op.same_as(op)]
    return bool(loads) and all(candidates[reader].in_place(reader, a, enc) for a in loads)


def _operands(program: TEProgram, op, enc):
    """(weight or None, [activation reads]) of a GEMM TE `op` that the policy converts: one reduction k, a
    product of two float32 reads, one a constant W that the encoding takes (the CPU's: W[k, j], j the last
    output axis, N a multiple of its lanes, K even), the other not indexed by j; or (where the encoding
    converts batch matmuls of activations) two activation reads of k; at least `enc.min_rows` rows; not
    a recurrence step. None otherwise."""
    product = product_reduction(op)
    if (product is None or len(op.reduce_axis) != 1 or len(op.axis) < 2 or member_of(op) is not None
            or str(op.output(0).dtype) != "float32"):
        return None
    if len(product.loads) != 2 or not all(isinstance(x, tvm.ir.Call) for x in (product.a, product.b)):
        return None
    k, j = op.reduce_axis[0].var, op.axis[-1].var
    rows = int(np.prod([int(iv.dom.extent) for iv in op.axis[:-1]]))
    weight, activations = None, []
    for load in (product.a, product.b):
        tensor, indices = load.args[0], list(load.args[1:])
        if str(tensor.dtype) != "float32" or not indices or not any(_uses(i, k) for i in indices):
            return None
        if (weight is None and isinstance(tensor.op, te.PlaceholderOp)
                and program.placeholder_kind(tensor) == "param" and enc.fits(tensor, indices, k, j)):
            weight = tensor
        elif isinstance(tensor.op, te.ComputeOp) or program.placeholder_kind(tensor) != "param":
            if not any(_uses(i, j) for i in indices) or enc.both_activations:
                activations.append(load)
    if rows < enc.min_rows or not activations:
        return None
    if weight is not None and len(activations) == 1:
        return weight, activations
    if weight is None and len(activations) == 2 and enc.both_activations:
        return None, activations
    return None


def _reads_rows_by_k(op, load) -> bool:
    """Whether the activation read is X[..., k] with k alone in the last index: consecutive k adjacent."""
    k = op.reduce_axis[0].var
    indices = list(load.args[1:])
    return indices[-1].same_as(k) and not any(_uses(i, k) for i in indices[:-1])


def _row_major_copy(op, load, source, enc) -> te.Tensor:
    """The activation that `op` reads through `load` (of `source`, its rebuilt tensor), rounded and laid
    out [rows..., K] in the GEMM's own axes, so that consecutive k are adjacent."""
    axes = [iv.var for iv in op.axis[:-1]] + [op.reduce_axis[0].var]
    extents = [int(iv.dom.extent) for iv in op.axis[:-1]] + [int(op.reduce_axis[0].dom.extent)]
    indices = list(load.args[1:])

    def value(*new):
        mapping = {var.__chandle__(): v for var, v in zip(axes, new)}
        return enc.round(source(*[substitute(i, mapping) for i in indices]))

    return te.compute(extents, value, name=f"{op.name}_operand{enc.suffix()}")


def _reading_reduced(op, weight, stored, reads, enc) -> te.ComputeOp:
    """`op` (rebuilt) with its weight read from the stored reduced constant and each activation from its
    reduced tensor (`reads[op](*indices)`)."""

    def rewrite(tensor, indices):
        if weight is not None and tensor.same_as(weight):
            return enc.read_weight(stored, indices)
        for source_op, read in reads.items():
            if tensor.op.same_as(source_op):
                return enc.widen(read(*indices))
        return None

    body = map_loads(op.body[0], rewrite)
    return te.ComputeOp(op.name, op.tag, {**(op.attrs or {}), **enc.annotation()}, op.axis, op.reduce_axis, [body])


def _uses(expr, var) -> bool:
    hits = []
    tvm_ffi.structural_walk(expr, [(tvm.tirx.Var, lambda v: hits.append(v.same_as(var)))])
    return any(hits)

