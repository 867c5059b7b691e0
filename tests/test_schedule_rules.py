"""schedule/rules: each default CPU rule on a small TensorIR function: which rules apply to its block, and
the loop nest the rule leaves (loop kinds and extents, annotations, blocks), as a before/expected pair;
the dispatcher's order, its fall-through to the next rule, and its failure policy. Structure only: the
values computed are checked by the schedule tests of each module (test_schedule_*.py)."""

import logging

import pytest
import tvm_ffi
from tvm import s_tir, te, tirx, topi

from souffle_py.cpu_target import using
from souffle_py.failures import STRICT_ENV, RuleFailedError
from souffle_py.schedule.rules.base import ScheduleRule
from souffle_py.schedule.rules.cpu import CPU_CHAIN_RULES, CPU_RULES
from souffle_py.schedule.rules.dispatch import apply_first, apply_rules
from souffle_py.schedule.thresholds import ROW_CHAIN_MIN_BYTES
from souffle_py.ir.marks import GATE_BLOCKS, GATE_CELL
from souffle_py.ir.marks import BF16_GEMM
from te_passes.precision import widen
from te_passes.precision_conv import BF16_CONV

AVX512 = "llvm -mcpu=sapphirerapids"  # 16 lanes, 32 registers: the numbers below are this target's


@pytest.fixture(autouse=True)
def avx512():
    with using(AVX512) as target:
        yield target


def _schedule(tensors, name):
    sch = s_tir.Schedule(te.create_prim_func(tensors))
    return sch, sch.get_sblock(name)


def _applying(sch, block, target) -> list[str]:
    return [rule.name for rule in CPU_RULES if rule.applies(sch, block, target)]


KINDS = {0: "serial", 1: "parallel", 2: "vectorized", 3: "unroll"}


def _nest(sch) -> list[str]:
    """The loops of the scheduled function in order, each 'depth kind extent', and its blocks as 'depth
    block name'."""
    lines = []

    def visit(stmt, depth):
        if isinstance(stmt, tirx.For):
            lines.append(f"{depth} {KINDS[int(stmt.kind)]} {int(stmt.extent)}")
            visit(stmt.body, depth + 1)
        elif isinstance(stmt, s_tir.SBlockRealize):
            if stmt.block.name_hint != "root":
                lines.append(f"{depth} block {stmt.block.name_hint}")
            visit(stmt.block.body, depth)
        elif isinstance(stmt, tirx.SeqStmt):
            for s in stmt:
                visit(s, depth)
        elif hasattr(stmt, "body"):
            visit(stmt.body, depth)
    visit(sch.mod["main"].body, 0)
    return lines


def _annotations(sch) -> dict[str, object]:
    found = {}

    def note(node):
        for key, value in node.annotations.items():
            found[str(key)] = value
    tvm_ffi.structural_walk(sch.mod["main"].body, [(tirx.For, note), (s_tir.SBlock, note)])
    return found


def _gemm(m=64, n=256, k=128, attrs=None):
    a, w = te.placeholder((m, k), name="A"), te.placeholder((k, n), name="W")
    r = te.reduce_axis((0, k), "k")
    return [a, w, te.compute((m, n), lambda i, j: te.sum(a[i, r] * w[r, j], axis=r), name="C", attrs=attrs)]


def _conv():
    x, w = te.placeholder((1, 32, 16, 16), name="x"), te.placeholder((64, 32, 3, 3), name="w")
    rc, kh, kw = te.reduce_axis((0, 32), "rc"), te.reduce_axis((0, 3), "kh"), te.reduce_axis((0, 3), "kw")
    return [x, w, te.compute((1, 64, 14, 14), lambda n, c, h, v: te.sum(
        x[n, rc, h + kh, v + kw] * w[c, rc, kh, kw], axis=[rc, kh, kw]), name="y")]


def _row_sum():
    x = te.placeholder((64, 256), name="x")
    k = te.reduce_axis((0, 256), "k")
    return [x, te.compute((64,), lambda i: te.sum(x[i, k], axis=k), name="s")]


def _pad():
    x = te.placeholder((4, 30, 30), name="x")
    return [x, topi.nn.pad(x, (0, 1, 1), (0, 1, 1), name="p")]


def _elementwise(attrs=None):
    x = te.placeholder((64, 256), name="x")
    return [x, te.compute((64, 256), lambda i, j: x[i, j] * 2.0 + 1.0, name="y", attrs=attrs)]


def _gates(groups=2, gates=4, units=64, depth=64):
    """An LSTM-like step as te_passes/gate_projections.py leaves it: the gate projection stored by groups
    [group, gate, unit] (GATE_BLOCKS), and a cell update over the units reading each unit's gates."""
    x, w = te.placeholder((depth,), name="x"), te.placeholder((groups, gates, units, depth), name="w")
    k = te.reduce_axis((0, depth), "k")
    proj = te.compute((groups, gates, units), lambda g, q, u: te.sum(x[k] * w[g, q, u, k], axis=k), name="proj",
                      attrs={GATE_BLOCKS: gates})
    cell = te.compute((groups * units,), lambda h: proj[h // units, 0, h % units] * proj[h // units, 1, h % units]
                      + proj[h // units, 2, h % units] - proj[h // units, 3, h % units], name="cell",
                      attrs={GATE_CELL: 1})
    return [x, w, cell]


def test_the_cpu_rules_are_tried_in_their_order():
    assert [r.name for r in CPU_CHAIN_RULES] == ["softmax GEMM", "row chain"]
    assert [r.name for r in CPU_RULES] == ["bf16_gemm", "bf16_conv", "vnni_gemm", "vnni_conv", "layout copy",
                                           "gate projection", "gemm", "conv",
                                           "reduction", "pad", "cell update", "injective"]
    assert all(isinstance(r, ScheduleRule) for r in CPU_RULES)


def test_gemm_panel(avx512):
    sch, block = _schedule(_gemm(), "C")
    assert _applying(sch, block, avx512) == ["gemm"]
    assert apply_first(sch, block, avx512).name == "gemm"
    assert _nest(sch) == [  # 8 x 32 register tiles (gemm_tile_rows x gemm_tile_columns), tiles in parallel
        "0 parallel 64",
        "1 unroll 8", "2 vectorized 32", "3 block C_init",
        "1 serial 128", "2 unroll 8", "3 vectorized 32", "4 block C_update",
        "1 serial 8", "2 vectorized 32", "3 block C_local",
    ]


def test_a_gemv_whose_columns_gather_reduces_in_vector_lanes(avx512):
    """One row, the weight read transposed (W[j, k]): dot products in vector lanes, no register tile."""
    x, w = te.placeholder((1, 256), name="x"), te.placeholder((1000, 256), name="W")
    k = te.reduce_axis((0, 256), "k")
    sch, block = _schedule([x, w, te.compute((1, 1000), lambda i, j: te.sum(x[i, k] * w[j, k], axis=k), name="C")],
                           "C")
    assert apply_first(sch, block, avx512).name == "gemm"
    assert "block C_local" not in _nest(sch) and any(line.endswith("block C_rf_update") for line in _nest(sch))
    assert any("vectorized 16" in line for line in _nest(sch))


def test_conv_tile(avx512):
    sch, block = _schedule(_conv(), "y")
    assert _applying(sch, block, avx512) == ["conv"]
    apply_first(sch, block, avx512)
    assert _nest(sch) == [  # 5 columns x 2 blocks of 32 channels, the 3x3 window unrolled, the last tile apart
        "0 parallel 14", "1 serial 3",
        "2 unroll 2", "3 unroll 5", "4 vectorized 32", "5 block y_init",
        "2 serial 32", "3 unroll 3", "4 unroll 3", "5 unroll 2", "6 unroll 5", "7 vectorized 32", "8 block y_update",
        "2 serial 64", "3 unroll 5", "4 block y_local",
    ]
    assert "souffle_last_tile_apart" in _annotations(sch)


def test_reduction(avx512):
    sch, block = _schedule(_row_sum(), "s")
    assert _applying(sch, block, avx512) == ["reduction"]
    apply_first(sch, block, avx512)
    assert _nest(sch) == [  # rows in parallel, 16 partial sums in a vector, then summed
        "0 parallel 64", "1 vectorized 16", "2 block s_rf_init",
        "1 serial 16", "2 vectorized 16", "3 block s_rf_update",
        "1 serial 16", "2 block s",
    ]


def test_padding(avx512):
    sch, block = _schedule(_pad(), "p")
    assert _applying(sch, block, avx512) == ["pad"]
    apply_first(sch, block, avx512)
    assert _nest(sch) == [  # rows in parallel, each cut at its borders into three plain loops
        "0 parallel 128", "1 block p_i2_common",
        "1 block p_i20_partition", "1 serial 1", "2 block p_i20",
        "1 block p_i21_partition", "1 serial 30", "2 block p_i21",
        "1 block p_i22_partition", "1 serial 1", "2 block p_i22",
    ]


def test_injective(avx512):
    sch, block = _schedule(_elementwise(), "y")
    assert _applying(sch, block, avx512) == ["injective"]
    apply_first(sch, block, avx512)
    assert _nest(sch) == ["0 parallel 1024", "1 vectorized 16", "2 block y"]


def test_gate_projection_and_cell_update(avx512):
    sch = s_tir.Schedule(te.create_prim_func(_gates()))
    proj, cell = sch.get_sblock("proj"), sch.get_sblock("cell")
    assert _applying(sch, proj, avx512) == ["gate projection", "gemm"]
    assert _applying(sch, cell, avx512) == ["cell update", "injective"]
    assert apply_first(sch, proj, avx512).name == "gate projection"
    assert apply_first(sch, cell, avx512).name == "cell update"
    assert _nest(sch) == [
        # a group's 4 gates x 64 units in one register tile (gates.group_units: 256 accumulator lanes), the
        # groups in parallel, the init left in the block until merge_groups (threads.py)
        "0 parallel 2", "1 serial 64", "2 unroll 4", "3 vectorized 64", "4 block proj",
        "1 serial 4", "2 vectorized 64", "3 block proj_local",
        # the cell updates by the same groups of 64 units
        "0 parallel 2", "1 serial 4", "2 vectorized 16", "3 block cell",
    ]
    assert int(sch.get(sch.get_sblock("proj_local")).annotations[GATE_BLOCKS]) == 4


def test_a_gate_projection_of_another_form_falls_through_to_the_gemm_rule(avx512):
    """Fewer than four loops: the gate rule declines (changes nothing) and the GEMM rule takes the block."""
    sch, block = _schedule(_gemm(attrs={GATE_BLOCKS: 4}), "C")
    assert _applying(sch, block, avx512) == ["gate projection", "gemm"]
    assert next(r for r in CPU_RULES if r.name == "gate projection").apply(sch, block, avx512) is False
    assert apply_first(sch, block, avx512).name == "gemm"
    assert "0 parallel 64" in _nest(sch)


def test_a_cell_update_without_its_projection_falls_through_to_the_injective_rule(avx512):
    sch, block = _schedule(_elementwise(attrs={GATE_CELL: 1}), "y")
    assert apply_first(sch, block, avx512).name == "injective"
    assert _nest(sch) == ["0 parallel 1024", "1 vectorized 16", "2 block y"]


def test_bf16_gemm(avx512):
    """A GEMM that te_passes/precision.py converted (its annotation) goes to vdpbf16ps micro-kernel tiles:
    16 columns x one k-pair tensorized, the instruction's LLVM IR imported (scheduling needs no AVX512_BF16
    on the host: nothing is compiled)."""
    a = te.placeholder((64, 96), "uint16", name="a")
    w = te.placeholder((4, 48, 16, 2), "uint16", name="w")
    k = te.reduce_axis((0, 96), name="k")
    c = te.compute((64, 64), lambda i, j: te.sum(widen(a[i, k]) * widen(w[j // 16, k // 2, j % 16, k % 2]), axis=k),
                   name="c", attrs={BF16_GEMM: 16})
    sch, block = _schedule([a, w, c], "c")
    assert _applying(sch, block, avx512) == ["bf16_gemm", "reduction"]  # widened loads: a reduction by shape
    assert apply_first(sch, block, avx512).name == "bf16_gemm"
    assert "pragma_import_llvm" in _annotations(sch)
    assert "souffle_dpbf16ps" in sch.mod["main"].script()


def test_vnni_gemm(avx512):
    """An integer GEMM in vpdpbusd's form (te_passes/int8_gemm.py's mark, 16 lanes) goes to VNNI micro-kernel
    tiles: 16 columns x 4 k tensorized, the instruction's LLVM IR imported; the plain form (mark 0) is a
    GEMM for the GEMM rule."""
    from te_passes.int8_gemm import INT8_GEMM
    a = te.placeholder((64, 96), "uint8", name="a")
    w = te.placeholder((4, 24, 16, 4), "int8", name="w")
    k = te.reduce_axis((0, 96), name="k")
    c = te.compute((64, 64), lambda i, j: te.sum(a[i, k].astype("int32") * w[j // 16, k // 4, j % 16, k % 4].astype(
        "int32"), axis=k), name="c", attrs={INT8_GEMM: 16})
    sch, block = _schedule([a, w, c], "c")
    assert _applying(sch, block, avx512)[0] == "vnni_gemm"
    assert apply_first(sch, block, avx512).name == "vnni_gemm"
    assert "pragma_import_llvm" in _annotations(sch)
    assert "souffle_vpdpbusd" in sch.mod["main"].script()
    plain = te.compute((64, 64), lambda i, j: te.sum(a[i, k].astype("int32") * w[j // 16, k // 4, j % 16, k % 4]
                                                      .astype("int32"), axis=k), name="p", attrs={INT8_GEMM: 0})
    sch, block = _schedule([a, w, plain], "p")
    assert "vnni_gemm" not in _applying(sch, block, avx512)


def test_vnni_gemm_computes_its_epilogue_in_the_write_back(avx512):
    """The scaling and bias of an int8 GEMM's int32 sum (a dynamically quantized GEMM's epilogue) run in the
    accumulators' write-back of each tile (epilogue.py), not in a pass over the int32 map of their own."""
    from souffle_py.schedule.epilogue import inline_tile_epilogues
    from te_passes.int8_gemm import INT8_GEMM
    a = te.placeholder((64, 96), "uint8", name="a")
    w = te.placeholder((4, 24, 16, 4), "int8", name="w")
    scale, bias = te.placeholder((64,), name="scale"), te.placeholder((64,), name="bias")
    k = te.reduce_axis((0, 96), name="k")
    c = te.compute((64, 64), lambda i, j: te.sum(a[i, k].astype("int32") * w[j // 16, k // 4, j % 16, k % 4].astype(
        "int32"), axis=k), name="c", attrs={INT8_GEMM: 16})
    y = te.compute((64, 64), lambda i, j: c[i, j].astype("float32") * scale[j] + bias[j], name="y")
    sch, block = _schedule([a, w, scale, bias, y], "c")
    assert apply_first(sch, block, avx512).name == "vnni_gemm"
    # inlined by TVM, or marked for the write-back where TVM refuses (a model's epilogue reads computed maps)
    finished = s_tir.Schedule(inline_tile_epilogues(sch.mod["main"]))
    blocks = [line.split()[-1] for line in _nest(finished) if "block" in line]
    assert blocks == ["c_init", "c_update_o", "c_local"]  # y is computed in c_local
    assert "y" in [region.source.name for region in finished.get(finished.get_sblock("c_local")).writes]


def test_vnni_gemm_computes_a_chain_of_two_epilogues_in_the_write_back(avx512):
    """A dynamically quantized GEMM's scaling, by a scale computed in the kernel (kernels.py moves it before
    the GEMM), then its activation: both in the write-back (epilogue.py `fuse_epilogue_chain`)."""
    from souffle_py.codegen.kernels import kernel_func
    from souffle_py.schedule.epilogue import TILE_EPILOGUE, inline_tile_epilogues
    from te_passes.int8_gemm import INT8_GEMM
    a = te.placeholder((64, 96), "uint8", name="a")
    w = te.placeholder((4, 24, 16, 4), "int8", name="w")
    x, bias = te.placeholder((2,), name="x"), te.placeholder((64,), name="bias")
    k = te.reduce_axis((0, 96), name="k")
    c = te.compute((64, 64), lambda i, j: te.sum(a[i, k].astype("int32") * w[j // 16, k // 4, j % 16, k % 4].astype(
        "int32"), axis=k), name="c", attrs={INT8_GEMM: 16})
    scale = te.compute((), lambda: x[0] * x[1], name="scale")
    y = te.compute((64, 64), lambda i, j: c[i, j].astype("float32") * scale() + bias[j], name="y")
    z = te.compute((64, 64), lambda i, j: tirx.max(y[i, j], tirx.const(0.0, "float32")), name="z")
    sch = s_tir.Schedule(kernel_func([a, w, x, bias, z], fast_math=False))
    assert apply_first(sch, sch.get_sblock("c"), avx512).name == "vnni_gemm"
    marked = {str(sch.get(b).annotations[TILE_EPILOGUE]) for b in (sch.get_sblock("y"), sch.get_sblock("z"))
              if TILE_EPILOGUE in sch.get(b).annotations}
    assert marked == {"c_local"}
    finished = s_tir.Schedule(inline_tile_epilogues(sch.mod["main"]))
    blocks = [line.split()[-1] for line in _nest(finished) if "block" in line]
    assert blocks == ["scale", "c_init", "c_update_o", "c_local"]
    assert "z" in [region.source.name for region in finished.get(finished.get_sblock("c_local")).writes]


def test_vnni_conv(avx512):
    """An integer convolution in vpdpbusd's form (te_passes/int8_conv_vnni.py's mark, 16 lanes): input quads
    [N, C / 4, H, W, 4], weight [F / 16, C / 4, kh, kw, 16, 4], on the VNNI conv tiles (a row of pixels x
    one or two vectors of filters); the plain form (mark 1) is a conv for the conv rule."""
    from te_passes.int8_conv_vnni import INT8_CONV
    x = te.placeholder((1, 8, 10, 10, 4), "uint8", name="x")
    w = te.placeholder((2, 8, 3, 3, 16, 4), "int8", name="w")
    cq, r, s_, q = (te.reduce_axis((0, e), name=n) for e, n in ((8, "cq"), (3, "r"), (3, "s"), (4, "q")))

    def conv(mark):
        return te.compute((1, 32, 8, 8), lambda n, f, y, v: te.sum(
            x[n, cq, y + r, v + s_, q].astype("int32") * w[f // 16, cq, r, s_, f % 16, q].astype("int32"),
            axis=[cq, r, s_, q]), name="y", attrs={INT8_CONV: mark})

    sch, block = _schedule([x, w, conv(16)], "y")
    assert _applying(sch, block, avx512)[0] == "vnni_conv"
    assert apply_first(sch, block, avx512).name == "vnni_conv"
    assert "pragma_import_llvm" in _annotations(sch)
    assert "souffle_vpdpbusd" in sch.mod["main"].script()
    sch, block = _schedule([x, w, conv(1)], "y")
    assert "vnni_conv" not in _applying(sch, block, avx512)


def test_layout_copy(avx512):
    """A copy into vpdpbusd's channel quads (LAYOUT_COPY): rows in parallel, the pixels of a map fused (its
    loads run contiguously over h and w), a vector's worth of them (16 lanes) x the 4 channels unrolled for
    LLVM's SLP vectorizer, the pixels no whole vector holds a loop of their own (7 x 7: 48 + 1); unmarked,
    the same copy is the injective rule's (4 lanes gathered H x W apart)."""
    from souffle_py.ir.marks import LAYOUT_COPY

    def copy(attrs, size=28, channels=64):
        x = te.placeholder((1, channels, size, size), "int8", name="x")
        return [x, te.compute((1, channels // 4, size, size, 4), lambda b, cq, h, w, q:
                              (x[b, cq * 4 + q, h, w].astype("int32") + 128).astype("uint8"), name="q", attrs=attrs)]

    sch, block = _schedule(copy({LAYOUT_COPY: 1}), "q")
    assert apply_first(sch, block, avx512).name == "layout copy"
    assert _nest(sch) == ["0 parallel 16", "1 serial 49", "2 unroll 16", "3 unroll 4", "4 block q"]
    sch, block = _schedule(copy({LAYOUT_COPY: 1}, size=7, channels=2048), "q")
    apply_first(sch, block, avx512)
    script = sch.mod["main"].script()
    assert "T.parallel(512)" in script and "range(3)" in script and "T.unroll(16)" in script
    assert "range(48, 49)" in script  # the tail pixel, a loop of its own
    sch, block = _schedule(copy(None), "q")
    assert apply_first(sch, block, avx512).name == "injective"


def test_bf16_conv_applies_before_the_conv_rule(avx512):
    x, w = te.placeholder((1, 32, 16, 16), name="x"), te.placeholder((64, 32, 3, 3), name="w")
    rc, kh, kw = te.reduce_axis((0, 32), "rc"), te.reduce_axis((0, 3), "kh"), te.reduce_axis((0, 3), "kw")
    y = te.compute((1, 64, 14, 14), lambda n, c, h, v: te.sum(x[n, rc, h + kh, v + kw] * w[c, rc, kh, kw],
                                                             axis=[rc, kh, kw]), name="y", attrs={BF16_CONV: 16})
    sch, block = _schedule([x, w, y], "y")
    assert _applying(sch, block, avx512) == ["bf16_conv", "conv"]


def _softmax(shape):
    x = te.placeholder(shape, name="x")
    k, k2 = te.reduce_axis((0, shape[-1]), "k"), te.reduce_axis((0, shape[-1]), "k2")
    row = (*shape[:-1], 1)
    mx = te.compute(row, lambda *i: te.max(x[(*i[:-1], k)], axis=k), name="mx")
    es = te.compute(row, lambda *i: te.sum(te.exp(x[(*i[:-1], k2)] - mx[(*i[:-1], 0)]), axis=k2), name="es")
    return [x, te.compute(shape, lambda *i: te.exp(x[i] - mx[(*i[:-1], 0)]) / es[(*i[:-1], 0)], name="y")]


@pytest.mark.parametrize("rows,chained", [(1024, True), (64, False)])
def test_row_chain(avx512, rows, chained):
    """A softmax beyond ROW_CHAIN_MIN_BYTES: its max and sum under the output's one parallel row loop; a
    smaller one is left to the block rules."""
    shape = (rows, 1024)
    assert (rows * 1024 * 4 >= ROW_CHAIN_MIN_BYTES) == chained
    sch = s_tir.Schedule(te.create_prim_func(_softmax(shape)))
    row_chain = CPU_CHAIN_RULES[1]
    scheduled = row_chain.schedule(sch, ["mx", "es", "y"], avx512)
    assert scheduled == ({"mx", "es", "y"} if chained else set())
    if chained:
        nest = _nest(sch)
        assert nest[0] == "0 parallel 1024" and sum("parallel" in line for line in nest) == 1


def _attention(tokens, dim=32):
    """softmax(S) . V over one head of `tokens` keys."""
    s, y = _softmax((1, 1, tokens, tokens))
    v = te.placeholder((1, 1, tokens, dim), name="v")
    k = te.reduce_axis((0, tokens), "k")
    return [s, v, te.compute((1, 1, tokens, dim), lambda b, h, i, j: te.sum(y[b, h, i, k] * v[b, h, k, j], axis=k),
                             name="context")]


@pytest.mark.parametrize("tokens,chained", [(1500, True), (128, False)])
def test_softmax_gemm_chain(avx512, tokens, chained):
    """Long attention: the softmax (max, sum, probabilities) under the context GEMM's row tiles, one
    parallel loop for all four blocks; short attention is left to the row chains and the block rules."""
    sch = s_tir.Schedule(te.create_prim_func(_attention(tokens)))
    names = ["mx", "es", "y", "context"]
    scheduled = CPU_CHAIN_RULES[0].schedule(sch, names, avx512)
    assert scheduled == (set(names) if chained else set())
    if chained:
        assert sum("parallel" in line for line in _nest(sch)) == 1


def test_the_dispatcher_leaves_chained_blocks_to_their_chain(avx512):
    sch = s_tir.Schedule(te.create_prim_func(_softmax((1024, 1024))))
    apply_rules(sch, ["mx", "es", "y"], lambda name: False)
    assert sum("parallel" in line for line in _nest(sch)) == 1


class _Broken(ScheduleRule):
    name = "broken"

    def applies(self, sch, block, target):
        return True

    def apply(self, sch, block, target):
        raise RuntimeError("a bug in a rule")


class _Declines(ScheduleRule):
    name = "declines"

    def applies(self, sch, block, target):
        return True

    def apply(self, sch, block, target):
        return False


def test_a_rule_that_declines_passes_the_block_on(avx512):
    sch, block = _schedule(_elementwise(), "y")
    assert apply_first(sch, block, avx512, (_Declines(), *CPU_RULES)).name == "injective"


def test_a_failing_rule_warns_naming_rule_and_block_and_ends_the_search(avx512, monkeypatch, caplog):
    monkeypatch.delenv(STRICT_ENV, raising=False)
    sch, block = _schedule(_elementwise(), "y")
    with caplog.at_level(logging.WARNING, logger="souffle_py.rules"):
        assert apply_first(sch, block, avx512, (_Broken(), *CPU_RULES)).name == "broken"
    assert "the default broken rule failed on y (RuntimeError: a bug in a rule)" in caplog.text
    assert _nest(sch) == ["0 serial 64", "1 serial 256", "2 block y"]  # the block as the rule left it
    monkeypatch.setenv(STRICT_ENV, "1")
    with pytest.raises(RuleFailedError, match="the default broken rule failed on y"):
        apply_first(sch, block, avx512, (_Broken(),))


def test_rules_hold_no_hardware_budget():
    """Register counts, lanes and cache sizes come from the CpuTarget (budgets.py, conv.py) or the measured
    thresholds (thresholds.py), never from a number in a rule module."""
    import ast
    from pathlib import Path

    import souffle_py.schedule.rules as rules

    hardware = ("REGISTER", "LANES", "BYTES", "L1", "L2", "L3", "CACHE", "ACCUMULATOR")
    for path in Path(rules.__file__).parent.glob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and \
                    isinstance(node.value.value, (int, float)) and not isinstance(node.value.value, bool):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
                assert not any(word in name.upper() for name in names for word in hardware), (path.name, names)
