"""Mixed precision: the GEMMs of a program read bfloat16 operands and accumulate in float32.

The policy is the usual one (PyTorch autocast, OpenVINO's bf16 inference): the two operands of a GEMM with
a constant weight are rounded to bfloat16 (8-bit mantissa, float32's exponent range), the products are
summed in float32, and everything else (softmax, normalizations, reductions, element-wise math, a
recurrence's state and its per-step GEMVs) stays float32.

- Weights are converted once, here, at compile time, and stored packed in K-pairs: W[K, N] becomes
  Wp[N / L, K / 2, L, 2] (L = LANES), so that one 64-byte row Wp[jb, kp] is exactly the register that the
  CPU's `vdpbf16ps` reads (L columns, each a pair of consecutive k) (schedule/bf16_gemm.py).
- Activations are converted by the TE that produces them: an element-wise producer read only by such
  GEMMs writes bfloat16 itself (its epilogue, no extra pass over memory); any other operand gets a
  conversion TE of its own, which the partitioner places in the kernel of its producer.

bfloat16 values are stored as their raw bits in uint16 tensors and widened with a shift: TVM 0.27 lowers
the bfloat16 type to float32 arithmetic on LLVM (BF16ComputeLegalize), and its LLVM code generator cannot
emit the `bfloat` vectors the instruction takes; the bits are handed to it by the micro-kernel
(schedule/bf16_gemm.py). Rounding is to nearest, ties to even, as the hardware converts.
"""

from __future__ import annotations

import logging

import numpy as np
import tvm
import tvm_ffi
from tvm import te, tirx

from souffle_py.program import TEProgram
from te_passes.exprs import substitute
from te_passes.graph import map_loads, rebuild_reading, tensor_key, tensor_loads
from te_passes.recurrence import member_of

log = logging.getLogger(__name__)

PRECISIONS = ("fp32", "bf16", "fp16")
LANES = 16        # float32 accumulators per vector register (AVX-512): the packed panel's width
PAIR = 2          # bfloat16 products per float32 lane that one vdpbf16ps sums
MIN_ROWS = 4      # fewer rows is a GEMV (a recurrence step's, a classifier's): memory-bound, left float32
BF16_GEMM = "souffle_bf16_gemm"  # TE attribute (a block annotation once merged): the packed panel's width
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


def reduce_precision(program: TEProgram, precision: str, lanes: int = LANES) -> TEProgram:
    """`program` under the mixed-precision policy `precision` ("fp32": unchanged; "bf16": see the module
    docstring). The caller (a backend) checks that its hardware serves the precision."""
    if precision == "fp32":
        return program
    if precision != "bf16":
        raise ValueError(f"reduce_precision: no TE rewrite for precision {precision!r}")
    return _bf16_gemms(program, lanes)


def _bf16_gemms(program: TEProgram, lanes: int) -> TEProgram:
    candidates = {op: found for op in program.stages if (found := _operands(program, op, lanes)) is not None}
    if not candidates:
        return program
    readers = program.consumers()
    outputs = {tensor_key(t) for t in program.outputs.values()}
    params, param_tensors = dict(program.params), dict(program.param_tensors)
    packed: dict[str, te.Tensor] = {}
    converted: dict[tuple, te.Tensor] = {}  # activation tensor key -> its bf16 tensor
    new_of: dict[tuple, te.Tensor] = {}
    in_epilogue = 0
    for op in program.stages:
        current = rebuild_reading(op, new_of, {})
        if op in candidates:
            weight, activation = candidates[op]
            if weight.op.name not in packed:
                name = _fresh(f"{weight.op.name}_bf16p{lanes}", params)
                params[name] = pack_pairs(program.params[weight.op.name], lanes)
                param_tensors[name] = packed[weight.op.name] = te.placeholder(params[name].shape, STORAGE, name=name)
            key = tensor_key(activation.args[0])
            source = new_of.get(key, activation.args[0])
            if _reads_rows_by_k(op, activation):
                if key not in converted:
                    converted[key] = te.compute(source.shape, lambda *i: to_bf16_bits(source(*i)),
                                                name=f"{activation.args[0].op.name}_bf16")
                current = _reading_bf16(current, weight, packed[weight.op.name], source, converted[key], lanes)
            else:  # read through a transpose (attention's context by head): a [rows, K] copy, rounded
                copy = _row_major_copy(op, activation, source)
                current = _reading_bf16(current, weight, packed[weight.op.name], source, copy, lanes,
                                        lambda *_: copy(*[iv.var for iv in op.axis[:-1]], op.reduce_axis[0].var))
            new_of[tensor_key(op.output(0))] = current.output(0)
        elif current is not op:
            for i in range(op.num_outputs):
                new_of[tensor_key(op.output(i))] = current.output(i)
        # an element-wise producer read only by converted GEMMs writes bfloat16 itself (its epilogue)
        key = tensor_key(op.output(0))
        if (op.num_outputs == 1 and not op.reduce_axis and key not in outputs and member_of(op) is None
                and readers.get(op) and all(r in candidates and candidates[r][1].args[0].op.same_as(op)
                                            and _reads_rows_by_k(r, candidates[r][1]) for r in readers[op])):
            body = current.body[0]
            epilogue = te.ComputeOp(f"{op.name}_bf16", op.tag, op.attrs, current.axis, [], [to_bf16_bits(body)])
            converted[key] = epilogue.output(0)
            in_epilogue += 1
    log.info("bf16: %d GEMMs read bfloat16 operands (%d weights packed in K-pairs, %d activations converted "
             "in their producer's epilogue)", len(candidates), len(packed), in_epilogue)
    return program.rebuilt(new_of, params, param_tensors)


def _operands(program: TEProgram, op, lanes: int):
    """(weight, activation read) of a GEMM TE `op` that the policy converts: one reduction k, a product of
    two float32 reads, one a constant W[k, j] (j the last output axis, N a multiple of `lanes`, K even), the
    other not indexed by j; at least MIN_ROWS rows; not a recurrence step. None otherwise."""
    if (not isinstance(op, te.ComputeOp) or op.num_outputs != 1 or len(op.reduce_axis) != 1 or len(op.axis) < 2
            or member_of(op) is not None or not isinstance(op.body[0], tvm.tirx.Reduce)
            or str(op.output(0).dtype) != "float32"):
        return None
    source = op.body[0].source[0]
    if not isinstance(source, tvm.tirx.Mul) or len(tensor_loads(source)) != 2:
        return None
    if not all(isinstance(x, tvm.ir.Call) for x in (source.a, source.b)):
        return None
    k, j = op.reduce_axis[0].var, op.axis[-1].var
    rows = int(np.prod([int(iv.dom.extent) for iv in op.axis[:-1]]))
    weight = activation = None
    for load in (source.a, source.b):
        tensor, indices = load.args[0], list(load.args[1:])
        if str(tensor.dtype) != "float32":
            return None
        if (isinstance(tensor.op, te.PlaceholderOp) and program.placeholder_kind(tensor) == "param"
                and len(indices) == 2 and indices[0].same_as(k) and indices[1].same_as(j)):
            weight = tensor
        elif indices and any(_uses(i, k) for i in indices) and not any(_uses(i, j) for i in indices):
            activation = load
    if weight is None or activation is None or rows < MIN_ROWS:
        return None
    n, depth = int(weight.shape[1]), int(weight.shape[0])
    if n % lanes or depth % PAIR:
        return None
    return weight, activation


def _reads_rows_by_k(op, load) -> bool:
    """Whether the activation read is X[..., k] with k alone in the last index: consecutive k adjacent."""
    k = op.reduce_axis[0].var
    indices = list(load.args[1:])
    return indices[-1].same_as(k) and not any(_uses(i, k) for i in indices[:-1])


def _row_major_copy(op, load, source) -> te.Tensor:
    """The activation that `op` reads through `load` (of `source`, its rebuilt tensor), rounded to bf16
    and laid out [rows..., K] in the GEMM's own axes, so that consecutive k are adjacent."""
    axes = [iv.var for iv in op.axis[:-1]] + [op.reduce_axis[0].var]
    extents = [int(iv.dom.extent) for iv in op.axis[:-1]] + [int(op.reduce_axis[0].dom.extent)]
    indices = list(load.args[1:])

    def value(*new):
        mapping = {var.__chandle__(): v for var, v in zip(axes, new)}
        return to_bf16_bits(source(*[substitute(i, mapping) for i in indices]))

    return te.compute(extents, value, name=f"{op.name}_operand_bf16")


def _reading_bf16(op, weight, packed, activation, converted, lanes: int, read=None) -> te.ComputeOp:
    """`op` (rebuilt) with its weight read from the packed pairs and its activation from the bf16 copy
    (`read(*indices)`, default converted at the same indices)."""
    read = read or converted

    def rewrite(tensor, indices):
        if tensor.same_as(weight):
            kk, j = indices
            return widen(packed[j // lanes, kk // PAIR, j % lanes, kk % PAIR])
        if tensor.op.same_as(activation.op):
            return widen(read(*indices))
        return None

    body = map_loads(op.body[0], rewrite)
    return te.ComputeOp(op.name, op.tag, {**(op.attrs or {}), BF16_GEMM: lanes}, op.axis, op.reduce_axis, [body])


def _uses(expr, var) -> bool:
    hits = []
    tvm_ffi.structural_walk(expr, [(tvm.tirx.Var, lambda v: hits.append(v.same_as(var)))])
    return any(hits)


def _fresh(base: str, taken) -> str:
    name, n = base, 1
    while name in taken:
        name, n = f"{base}_{n}", n + 1
    return name
