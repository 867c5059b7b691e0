"""The target's four-deep u8 x s8 dot product, the instruction the int8 micro-kernels are tensorized onto
(int8_gemm.py, int8_conv.py, int8_pixel_conv.py): in each of `lanes` int32 lanes,

    acc[l] += a[4l] b[4l] + a[4l+1] b[4l+1] + a[4l+2] b[4l+2] + a[4l+3] b[4l+3]    (a uint8, b int8)

- AVX512_VNNI: `vpdpbusd` on zmm registers, 16 lanes.
- AVX-VNNI (Intel's client cores since Alder Lake, Sierra Forest, AMD Zen 5 without AVX-512's VNNI): the
  same instruction VEX-encoded on ymm registers, 8 lanes (LLVM selects it from the same intrinsic).
- AVX2 (Haswell and later, AMD Zen 1-3) and AVX512BW without VNNI (Skylake-SP): no such instruction. It is
  computed exactly by two `vpmaddwd`: each operand's bytes split into their even and odd halves widened to
  16 bits (uint8 zero-extended, int8 sign-extended), each vpmaddwd summing two products per int32 lane (at
  most 2 x 255 x 128, far from overflow). ONNX Runtime's and oneDNN's AVX2 kernels use `vpmaddubsw`
  instead, whose int16 sums saturate for uint8 x int8 pairs above 32767; the same two multiply-pipe
  instructions per 32 products, so exactness costs one vector add per 32 products. The operands are
  split before the loop (`split_weights`; te_passes/dot_weights.py): the weights once when te_passes
  pack them (int16 halves), the GEMM's and channel-lane conv's activations when they are copied into
  quads (widened to int16: the `_wide` function, two 32-bit pairs broadcast). The loop then issues the
  4 ALU instructions per 32 products the exact form needs (2 vpmaddwd, 2 vpaddd) beside its loads; the
  pixel-lane conv still splits its loaded input vector (2 more per vector, shared by its channels). A 3 x
  3 conv's loop (64 channels, 28 x 28): 9.3 -> 6.0 instructions per 32 products.
- AVX2 and AVX512BW without VNNI, in the stages the compile lets saturate (`optimize(int8="saturating")`,
  `saturation_allowed`; scheduled under `arithmetic("saturating")`): ONNX Runtime's and OpenVINO's form,
  `vpmaddubsw` (two u8 x s8 products summed into an int16 that saturates at +-32767) then `vpmaddwd` by
  ones into int32: 2 multiply-pipe instructions and 1 add per 32 products, the same weight layout as
  vpdpbusd. Its loop runs 1.3x faster than the exact form's on Zen 3 (4 x 2 tile, L1-resident: 1.05
  against 1.37 cycles per 32 products); where a pair's sum passes 32767 the result is the saturated one,
  as those runtimes' (docs/precision.md). A stage whose weights no pair of which can saturate
  (te_passes/dot_weights.py `pairs_bounded`) takes it under "exact" too, exactly (`stage_arithmetic`).
  "saturating" gives it only to the stages whose uint8 activations have a low zero point
  (`SATURATING_ZERO_POINT`: ReLU-like outputs, mostly small values) or one set at run time (a
  DynamicQuantizeLinear's, as ONNX Runtime's dynamic GEMMs): zero-centred activations (an image, a
  residual stream, a projection's output; int8 ones shifted by 128) sit around 128, where pairs of large
  weights pass 32767 often, and those stages keep the exact form.
- Anything else (AArch64, x86 without AVX2): None, the plain int32 form (te_passes/int8_gemm.py).

Each implementation is a small LLVM IR function over int32 vectors, imported into the kernel with
`pragma_import_llvm` and inlined (LLVM 22 declares vpdpbusd over byte vectors, which TVM's
call_llvm_pure_intrin does not pass); its tensor intrinsics are registered on first use, one for the GEMM's
form (a: one broadcast quad) and one for the pixel-lane convolution's (b: one broadcast quad).

Weight layouts: te_passes/dot_weights.py (PLAIN for vpdpbusd and vpmaddubsw: gemm_intrinsic and
pixel_intrinsic; for the split forms LOW_HIGH, wide_intrinsic, the GEMMs' and channel-lane convs', and
EVEN_ODD_PIXELS, pixel_intrinsic).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools

from tvm.s_tir import TensorIntrin
from tvm.script import tirx as T

from souffle_py.cpu_target import CpuTarget

ARITHMETICS = ("exact", "saturating")  # optimize(int8=...): whether vpmaddubsw's saturating form may serve AVX2
_ARITHMETIC = contextvars.ContextVar("souffle_int8_arithmetic", default="exact")  # the form scheduled
_OPTION = contextvars.ContextVar("souffle_int8_option", default="exact")  # the compile's optimize(int8=...)
# The largest uint8 zero point of activations that int8="saturating" lets saturate: an eighth of the range,
# where ReLU-like outputs sit (ReLU's 0, SiLU's, GELU's and HardSwish's a few steps above), far below the
# zero-centred ones' 128 (a pair's int16 sum at the zero point alone is then at most 2 x 32 x 128 = 8192).
SATURATING_ZERO_POINT = 32
DEPTH = 4  # products per int32 lane (an ISA fact of vpdpbusd; the emulation keeps its operands' layout)


@dataclasses.dataclass(frozen=True)
class Dot4:
    """One implementation of the dot product: `lanes` int32 lanes, `function` the LLVM function the
    tensor intrinsics call, `llvm_ir` its definition, `operand_registers` the vector registers each loaded
    operand takes in a tile (2 where it is split into even and odd halves; the saturating form's int16
    products and its ones take two registers of every tile, but counting its operands as one each ran
    ResNet-50 2-3% faster, A/B on Zen 3). `register()` registers its
    intrinsics (`gemm_intrinsic`, `pixel_intrinsic`) with TVM: finish_micro_kernel calls it on first use."""

    lanes: int
    instruction: str
    function: str
    llvm_ir: str
    operand_registers: int = 1
    split_weights: bool = False  # weights packed as int16 even and odd halves (module docstring)

    @property
    def weight_bytes(self) -> int:
        """Bytes per packed weight value."""
        return 2 if self.split_weights else 1

    @property
    def gemm_intrinsic(self) -> str:
        return f"souffle_dot_{self.function}"

    @property
    def pixel_intrinsic(self) -> str:
        return f"souffle_dot_{self.function}_pixels"

    @property
    def wide_intrinsic(self) -> str:
        """The GEMM form over activations widened to int16 in memory (split weights only)."""
        return f"souffle_dot_{self.function}_wide"

    def register(self) -> None:
        _register(self)


def _vpdpbusd(lanes: int, function: str) -> str:
    return f"""
define linkonce_odr <{lanes} x i32> @{function}(<{lanes} x i32> %acc, <{lanes} x i32> %a, <{lanes} x i32> %b) alwaysinline {{
  %x = bitcast <{lanes} x i32> %a to <{4 * lanes} x i8>
  %y = bitcast <{lanes} x i32> %b to <{4 * lanes} x i8>
  %r = call <{lanes} x i32> @llvm.x86.avx512.vpdpbusd.{32 * lanes}(<{lanes} x i32> %acc, <{4 * lanes} x i8> %x, <{4 * lanes} x i8> %y)
  ret <{lanes} x i32> %r
}}
declare <{lanes} x i32> @llvm.x86.avx512.vpdpbusd.{32 * lanes}(<{lanes} x i32>, <{4 * lanes} x i8>, <{4 * lanes} x i8>)
"""


PMADDWD = {8: "llvm.x86.avx2.pmadd.wd", 16: "llvm.x86.avx512.pmaddw.d.512"}
PMADDUBSW = {8: "llvm.x86.avx2.pmadd.ub.sw", 16: "llvm.x86.avx512.pmaddubs.w.512"}


def _pmaddubsw(lanes: int, function: str) -> str:
    """acc + a . b as vpmaddubsw (u8 x s8 pairs into saturating int16) then vpmaddwd by ones (module
    docstring); the operands as vpdpbusd's."""
    words, bytes_ = f"<{2 * lanes} x i16>", f"<{4 * lanes} x i8>"
    vector = f"<{lanes} x i32>"
    ones = "<" + ", ".join(["i16 1"] * (2 * lanes)) + ">"
    return f"""
define linkonce_odr {vector} @{function}({vector} %acc, {vector} %a, {vector} %b) alwaysinline {{
  %x = bitcast {vector} %a to {bytes_}
  %y = bitcast {vector} %b to {bytes_}
  %pairs = call {words} @{PMADDUBSW[lanes]}({bytes_} %x, {bytes_} %y)
  %quads = call {vector} @{PMADDWD[lanes]}({words} %pairs, {words} {ones})
  %r = add {vector} %acc, %quads
  ret {vector} %r
}}
declare {words} @{PMADDUBSW[lanes]}({bytes_}, {bytes_})
declare {vector} @{PMADDWD[lanes]}({words}, {words})
"""


def _pmaddwd_pairs(lanes: int, function: str) -> str:
    """Two functions: `function`, acc + a . b with a's uint8 quads split here (even and odd bytes, widened)
    and b split already, its even and odd int16 halves; `function`_wide, acc + a0 . b0 + a1 . b1 with both
    operands split already (activations widened to int16 in memory, te_passes/dot_weights.LOW_HIGH)."""
    words = f"<{2 * lanes} x i16>"
    vector = f"<{lanes} x i32>"
    splat = lambda value: "<" + ", ".join([f"i16 {value}"] * (2 * lanes)) + ">"  # noqa: E731
    return f"""
define linkonce_odr {vector} @{function}_wide({vector} %acc, {vector} %a0, {vector} %a1, {vector} %b0, {vector} %b1) alwaysinline {{
  %x0 = bitcast {vector} %a0 to {words}
  %x1 = bitcast {vector} %a1 to {words}
  %y0 = bitcast {vector} %b0 to {words}
  %y1 = bitcast {vector} %b1 to {words}
  %first = call {vector} @{PMADDWD[lanes]}({words} %x0, {words} %y0)
  %second = call {vector} @{PMADDWD[lanes]}({words} %x1, {words} %y1)
  %sum = add {vector} %first, %second
  %r = add {vector} %acc, %sum
  ret {vector} %r
}}
define linkonce_odr {vector} @{function}({vector} %acc, {vector} %a, {vector} %b0, {vector} %b1) alwaysinline {{
  %a16 = bitcast {vector} %a to {words}
  %a_even = and {words} %a16, {splat(255)}
  %a_odd = lshr {words} %a16, {splat(8)}
  %x0 = bitcast {words} %a_even to {vector}
  %x1 = bitcast {words} %a_odd to {vector}
  %r = call {vector} @{function}_wide({vector} %acc, {vector} %x0, {vector} %x1, {vector} %b0, {vector} %b1)
  ret {vector} %r
}}
declare {vector} @{PMADDWD[lanes]}({words}, {words})
"""


VPDPBUSD_512 = Dot4(16, "vpdpbusd", "souffle_vpdpbusd", _vpdpbusd(16, "souffle_vpdpbusd"))
VPDPBUSD_256 = Dot4(8, "vpdpbusd (AVX-VNNI)", "souffle_vpdpbusd_256", _vpdpbusd(8, "souffle_vpdpbusd_256"))
PAIRS_512 = Dot4(16, "vpmaddwd pairs", "souffle_dot4_pmaddwd_512", _pmaddwd_pairs(16, "souffle_dot4_pmaddwd_512"), 2,
                 True)
PAIRS_256 = Dot4(8, "vpmaddwd pairs", "souffle_dot4_pmaddwd_256", _pmaddwd_pairs(8, "souffle_dot4_pmaddwd_256"), 2,
                 True)

SATURATING_512 = Dot4(16, "vpmaddubsw (saturating)", "souffle_dot4_pmaddubsw_512",
                      _pmaddubsw(16, "souffle_dot4_pmaddubsw_512"))
SATURATING_256 = Dot4(8, "vpmaddubsw (saturating)", "souffle_dot4_pmaddubsw_256",
                      _pmaddubsw(8, "souffle_dot4_pmaddubsw_256"))


def arithmetic(value: str):
    """Schedule within: "exact" (default) or "saturating", whether dot4() picks the vpmaddubsw form
    (`stage_arithmetic` sets it per stage; a context variable, as cpu_target.using)."""
    return _within(_ARITHMETIC, value)


def int8_option(value: str):
    """Compile within optimize(int8=`value`): "exact" or "saturating", whether `saturation_allowed` lets the
    int8 pass give stages the saturating form."""
    return _within(_OPTION, value)


@contextlib.contextmanager
def _within(variable: contextvars.ContextVar, value: str):
    if value not in ARITHMETICS:
        raise ValueError(f"int8 arithmetic must be one of {ARITHMETICS}, got {value!r}")
    token = variable.set(value)
    try:
        yield
    finally:
        variable.reset(token)


def saturation_allowed(zero_point: int | None) -> bool:
    """Whether the compile lets a dot-product stage whose uint8 activations have `zero_point` (None: set at
    run time) saturate (module docstring; te_passes/dot_weights.pair_form decides the stage's form)."""
    return _OPTION.get() == "saturating" and _saturable(zero_point)


def _saturable(zero_point: int | None) -> bool:
    """Whether int8="saturating" lets a stage whose activations have `zero_point` saturate."""
    return zero_point is None or zero_point <= SATURATING_ZERO_POINT


def dot4(target: CpuTarget | None = None) -> Dot4 | None:
    """The dot product of `target` (the CPU being compiled for by default) under the current `arithmetic()`
    (module docstring), or None."""
    target = target or CpuTarget.current()
    if target.arch != "x86_64" or not target.avx2:
        return None
    saturating = _ARITHMETIC.get() == "saturating"
    if target.vector_bits >= 512 and target.avx512bw:
        return VPDPBUSD_512 if target.avx512_vnni else SATURATING_512 if saturating else PAIRS_512
    if target.avxvnni or target.avx512_vnni:
        return VPDPBUSD_256
    return SATURATING_256 if saturating else PAIRS_256


SATURATING_NOTE = ('int8="saturating": the int8 GEMMs and convolutions whose activations have a low (ReLU-like) '
                   "or run-time zero point sum pairs of products with vpmaddubsw, whose int16 sums saturate at "
                   "+-32767 (ONNX Runtime's and OpenVINO's AVX2 arithmetic)")
EXACT_NOTE = ('int8="exact" on a CPU without VNNI: {count} int8 GEMMs and convolutions sum their products exactly '
              "(two vpmaddwd and two adds per 32 products) where int8=\"saturating\" would give them vpmaddubsw, "
              "the saturating arithmetic ONNX Runtime and OpenVINO use on such a CPU (their activations have a low "
              "or run-time zero point; on AMD Zen 3 the option ran a dynamically quantized BERT-base 1.42x and a QDQ "
              "ResNet-50 1.32x faster: docs/benchmarks.md)")


def int8_notes(stages) -> tuple[str, ...]:
    """The plan's record of the int8 arithmetic the compile chose: SATURATING_NOTE where int8="saturating" gave
    a stage the saturating form (its SATURATING_PAIRS mark), EXACT_NOTE where stages kept the exact split
    form that int8="saturating" would have changed (their SPLIT_ZERO_POINT mark: what a user of the default
    needs to know to choose)."""
    from te_passes.dot_weights import RUN_TIME, SATURATING_PAIRS, SPLIT_ZERO_POINT

    marks = [op.attrs or {} for op in stages]
    notes = (SATURATING_NOTE,) if any(int(m.get(SATURATING_PAIRS, 0)) for m in marks) else ()
    zero_points = [int(m[SPLIT_ZERO_POINT]) for m in marks if SPLIT_ZERO_POINT in m]
    eligible = sum(_saturable(None if zero == RUN_TIME else zero) for zero in zero_points)
    return notes + ((EXACT_NOTE.format(count=eligible),) if eligible else ())


def stage_arithmetic(sch, block):
    """The arithmetic a dot-product stage is scheduled under: "saturating" where te_passes gave it that form
    (NARROW_PAIRS: exact for its weights; SATURATING_PAIRS: int8="saturating"), else "exact"."""
    from te_passes.dot_weights import NARROW_PAIRS, SATURATING_PAIRS

    annotations = sch.get(block).annotations
    marked = any(int(annotations.get(mark, 0)) for mark in (NARROW_PAIRS, SATURATING_PAIRS))
    return arithmetic("saturating" if marked else "exact")


def split_weights() -> bool:
    """Whether the target's dot product reads its weights split into int16 halves (te_passes/dot_weights.py)."""
    found = dot4()
    return found is not None and found.split_weights


def dot4_lanes() -> int:
    """The int32 lanes of the target's dot product (16 on AVX-512, 8 on AVX2), 0 where there is none: the
    lanes te_passes/int8_gemm.py and int8_conv_vnni.py pack weights for."""
    found = dot4()
    return found.lanes if found is not None else 0


@functools.cache
def _register(dot: Dot4) -> None:
    """Register `dot`'s two tensor intrinsics with TVM on first use (parsing TVMScript at import costs every
    compile)."""
    if dot.split_weights:  # the GEMMs and channel-lane convs read widened inputs (the wide form) instead
        TensorIntrin.register(dot.wide_intrinsic, *_wide_form(dot), override=True)
        TensorIntrin.register(dot.pixel_intrinsic, *_split_pixel_form(dot), override=True)
        return
    lanes, function = dot.lanes, dot.function
    vector, words = f"int32x{lanes}", f"int8x{4 * lanes}"

    @T.prim_func(s_tir=True)
    def gemm_desc(a: T.Buffer((4,), "uint8", offset_factor=1), b: T.Buffer((lanes, 4), "int8", offset_factor=1),
                  c: T.Buffer((lanes,), "int32", offset_factor=1, scope="local")) -> None:
        with T.sblock("root"):
            T.reads(c[0:lanes], a[0:4], b[0:lanes, 0:4])
            T.writes(c[0:lanes])
            for i in T.serial(0, lanes):
                for k in T.serial(0, 4):
                    with T.sblock("update"):
                        vi, vk = T.axis.remap("SR", [i, k])
                        c[vi] = c[vi] + T.cast(a[vk], "int32") * T.cast(b[vi, vk], "int32")

    @T.prim_func(s_tir=True)
    def gemm_impl(a: T.Buffer((4,), "uint8", offset_factor=1), b: T.Buffer((lanes, 4), "int8", offset_factor=1),
                  c: T.Buffer((lanes,), "int32", offset_factor=1, scope="local")) -> None:
        with T.sblock("root"):
            T.reads(c[0:lanes], a[0:4], b[0:lanes, 0:4])
            T.writes(c[0:lanes])
            quad = T.reinterpret(a.vload([0], "uint8x4"), dtype="int32")
            c[T.ramp(T.int32(0), 1, lanes)] = T.call_pure_extern(
                vector, function, c.vload([0], dtype=vector), T.broadcast(quad, lanes),
                T.reinterpret(b.vload([0, 0], dtype=words), dtype=vector))

    @T.prim_func(s_tir=True)
    def pixel_desc(a: T.Buffer((lanes, 4), "uint8", offset_factor=1), b: T.Buffer((4,), "int8", offset_factor=1),
                   c: T.Buffer((lanes,), "int32", offset_factor=1, scope="local")) -> None:
        with T.sblock("root"):
            T.reads(c[0:lanes], a[0:lanes, 0:4], b[0:4])
            T.writes(c[0:lanes])
            for i in T.serial(0, lanes):
                for k in T.serial(0, 4):
                    with T.sblock("update"):
                        vi, vk = T.axis.remap("SR", [i, k])
                        c[vi] = c[vi] + T.cast(a[vi, vk], "int32") * T.cast(b[vk], "int32")

    @T.prim_func(s_tir=True)
    def pixel_impl(a: T.Buffer((lanes, 4), "uint8", offset_factor=1), b: T.Buffer((4,), "int8", offset_factor=1),
                   c: T.Buffer((lanes,), "int32", offset_factor=1, scope="local")) -> None:
        with T.sblock("root"):
            T.reads(c[0:lanes], a[0:lanes, 0:4], b[0:4])
            T.writes(c[0:lanes])
            quad = T.reinterpret(b.vload([0], "int8x4"), dtype="int32")
            c[T.ramp(T.int32(0), 1, lanes)] = T.call_pure_extern(
                vector, function, c.vload([0], dtype=vector),
                T.reinterpret(a.vload([0, 0], dtype=f"uint8x{4 * lanes}"), dtype=vector), T.broadcast(quad, lanes))

    TensorIntrin.register(dot.gemm_intrinsic, gemm_desc, gemm_impl, override=True)
    TensorIntrin.register(dot.pixel_intrinsic, pixel_desc, pixel_impl, override=True)


def _wide_form(dot: Dot4):
    """The GEMM form's description and implementation over an activation quad widened to int16 in memory
    and weights packed LOW_HIGH (module docstring): two 32-bit pairs broadcast, no split in the loop."""
    lanes, function = dot.lanes, f"{dot.function}_wide"
    vector, halves = f"int32x{lanes}", f"int16x{2 * lanes}"

    @T.prim_func(s_tir=True)
    def desc(a: T.Buffer((4,), "int16", offset_factor=1), b: T.Buffer((2, lanes, 2), "int16", offset_factor=1),
             c: T.Buffer((lanes,), "int32", offset_factor=1, scope="local")) -> None:
        with T.sblock("root"):
            T.reads(c[0:lanes], a[0:4], b[0:2, 0:lanes, 0:2])
            T.writes(c[0:lanes])
            for i in T.serial(0, lanes):
                for k in T.serial(0, 4):
                    with T.sblock("update"):
                        vi, vk = T.axis.remap("SR", [i, k])
                        c[vi] = c[vi] + T.cast(a[vk], "int32") * T.cast(b[vk // 2, vi, vk % 2], "int32")

    @T.prim_func(s_tir=True)
    def impl(a: T.Buffer((4,), "int16", offset_factor=1), b: T.Buffer((2, lanes, 2), "int16", offset_factor=1),
             c: T.Buffer((lanes,), "int32", offset_factor=1, scope="local")) -> None:
        with T.sblock("root"):
            T.reads(c[0:lanes], a[0:4], b[0:2, 0:lanes, 0:2])
            T.writes(c[0:lanes])
            low = T.reinterpret(a.vload([0], "int16x2"), dtype="int32")
            high = T.reinterpret(a.vload([2], "int16x2"), dtype="int32")
            c[T.ramp(T.int32(0), 1, lanes)] = T.call_pure_extern(
                vector, function, c.vload([0], dtype=vector), T.broadcast(low, lanes), T.broadcast(high, lanes),
                T.reinterpret(b.vload([0, 0, 0], dtype=halves), dtype=vector),
                T.reinterpret(b.vload([1, 0, 0], dtype=halves), dtype=vector))

    return desc, impl


def _split_pixel_form(dot: Dot4):
    """The pixel-lane form's description and implementation over one lane's weights split into int16
    halves ([2, 2], dot_weights.EVEN_ODD_PIXELS) and a uint8 input vector the function splits."""
    lanes, function = dot.lanes, dot.function
    vector = f"int32x{lanes}"

    @T.prim_func(s_tir=True)
    def pixel_desc(a: T.Buffer((lanes, 4), "uint8", offset_factor=1), b: T.Buffer((2, 2), "int16", offset_factor=1),
                   c: T.Buffer((lanes,), "int32", offset_factor=1, scope="local")) -> None:
        with T.sblock("root"):
            T.reads(c[0:lanes], a[0:lanes, 0:4], b[0:2, 0:2])
            T.writes(c[0:lanes])
            for i in T.serial(0, lanes):
                for k in T.serial(0, 4):
                    with T.sblock("update"):
                        vi, vk = T.axis.remap("SR", [i, k])
                        c[vi] = c[vi] + T.cast(a[vi, vk], "int32") * T.cast(b[vk % 2, vk // 2], "int32")

    @T.prim_func(s_tir=True)
    def pixel_impl(a: T.Buffer((lanes, 4), "uint8", offset_factor=1), b: T.Buffer((2, 2), "int16", offset_factor=1),
                   c: T.Buffer((lanes,), "int32", offset_factor=1, scope="local")) -> None:
        with T.sblock("root"):
            T.reads(c[0:lanes], a[0:lanes, 0:4], b[0:2, 0:2])
            T.writes(c[0:lanes])
            even = T.reinterpret(b.vload([0, 0], "int16x2"), dtype="int32")
            odd = T.reinterpret(b.vload([1, 0], "int16x2"), dtype="int32")
            c[T.ramp(T.int32(0), 1, lanes)] = T.call_pure_extern(
                vector, function, c.vload([0], dtype=vector),
                T.reinterpret(a.vload([0, 0], dtype=f"uint8x{4 * lanes}"), dtype=vector),
                T.broadcast(even, lanes), T.broadcast(odd, lanes))

    return pixel_desc, pixel_impl
