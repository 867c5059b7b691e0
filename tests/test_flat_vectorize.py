"""schedule/flat.py: memory-bound work over maps and rows of any size (7, 14, 49, 58 channels) is vectorized
and computes what ONNX Runtime computes. Tiny graphs of the patterns that stayed scalar: a ShuffleNetV2
unit's channel split, concat and shuffle over 58 channels, elementwise chains and hard-swish over 7 x 7 and
14 x 14 maps, global average pools, softmax and layer norms over rows of 7, 14, 49 and 197, a dense block's
concat feeding a conv."""

import re

import numpy as np
import pytest
import tvm
import tvm_ffi
from onnx import TensorProto
from tvm import s_tir, te, tirx

import souffle_py
from models.common import GraphBuilder, conv_bn
from souffle_py.codegen.stack_locals import PIPELINE
from souffle_py.schedule.blocks import vector_lanes
from souffle_py.schedule.default import schedule_cpu
from souffle_py.schedule.flat import RAGGED, contiguous_suffix, flat_lanes, restore_ragged_predicates
from souffle_py.target import resolve_target
from tests.onnx_cases import assert_matches_ort

VECTOR = vector_lanes()  # the host's: what a test outside cpu_target.using compiles for

TARGET = resolve_target("llvm")


def _rand(*shape, seed=0):
    return np.random.default_rng(seed + sum(shape)).standard_normal(shape).astype(np.float32)


def _vectorized_blocks_raw(func) -> dict[str, bool]:
    """Each leaf block's name -> whether a vectorized loop encloses it."""
    found: dict[str, bool] = {}

    def visit(stmt, vectorized):
        if isinstance(stmt, tirx.For):
            visit(stmt.body, vectorized or int(stmt.kind) == 2)
        elif isinstance(stmt, s_tir.stmt.SBlockRealize):
            block = stmt.block
            children = []
            tvm_ffi.structural_walk(block.body, [(s_tir.stmt.SBlock, children.append)])
            if not children and block.name_hint != "root":
                found[block.name_hint] = found.get(block.name_hint, False) or vectorized
            visit(block.body, vectorized)
            if block.init is not None:
                visit(block.init, vectorized)
        elif isinstance(stmt, tirx.SeqStmt):
            for s in stmt.seq:
                visit(s, vectorized)
        elif hasattr(stmt, "body"):
            visit(stmt.body, vectorized)

    visit(func.body, False)
    return found


def _vectorized_blocks(func) -> dict[str, bool]:
    """Each leaf block's name -> whether a vectorized loop encloses it. The pieces of a loop partition
    (`<name>_<loop>0`, `<name>_<loop>1`, ...) count as one: whole vectors and their tail, or the pieces of
    a row cut at its conditions, which LLVM vectorizes (flat.py)."""
    found = _vectorized_blocks_raw(func)
    pieces: dict[str, list[str]] = {}
    for name in found:
        if name[-1].isdigit():
            pieces.setdefault(name[:-1], []).append(name)
    tails = [name for group in pieces.values() if len(group) > 1 for name in group if name[-1] != "0"]
    for group in pieces.values():
        if len(group) > 1:
            found[group[0]] = True
    # a reduction's sum of its vector lanes (after its `_rf` partial results) is scalar by design
    # (the partial results' update may be partitioned: whole vectors `_rf_update_<loop>0`, the masked last one)
    lane_sums = [name for name in found if any(other.startswith(f"{name}_rf_update") and vector
                                               for other, vector in found.items())]
    return {name: vector for name, vector in found.items() if name not in tails + lane_sums}


def _scalar_blocks(model) -> list[str]:
    """Blocks of the compiled model's kernels, as the default CPU schedule leaves them, with no vector."""
    scalar = []
    for kernel in model.kernels:
        scalar += [f"{kernel.name}/{name}" for name, vector in _vectorized_blocks(schedule_cpu(kernel.func)).items()
                   if not vector]
    return scalar


# --- the rules on single TEs ------------------------------------------------------------------------------

def test_flat_lanes_cover_short_runs_with_a_tail():
    assert flat_lanes(49) == VECTOR and flat_lanes(7) == 4 and flat_lanes(14) == 8 and flat_lanes(4) == 4


def test_a_concat_condition_stops_the_run_at_its_axis():
    """A concat over channels selects by channel: the run covers h and w (uniform condition), not c."""
    a, b = te.placeholder((1, 3, 7, 7), name="a"), te.placeholder((1, 5, 7, 7), name="b")
    y = te.compute((1, 8, 7, 7), lambda n, c, h, w: tvm.tirx.if_then_else(c < 3, a[n, c, h, w],
                                                                        b[n, c - 3, h, w]), name="y")
    block = s_tir.Schedule(te.create_prim_func([a, b, y])).mod["main"].body.block.body.body.body.body.body.block
    assert contiguous_suffix(block, list(block.iter_vars)) == 2


def test_a_transposed_read_stops_the_run():
    x = te.placeholder((7, 9), name="x")
    y = te.compute((9, 7), lambda i, j: x[j, i], name="y")
    block = te.create_prim_func([x, y]).body.block.body.body.body.block
    assert contiguous_suffix(block, list(block.iter_vars)) == 0


@pytest.mark.parametrize("size", [7, 28])
def test_a_pad_row_is_cut_at_its_borders(size):
    """A pad with BN + ReLU (a depthwise conv's input): the row cut at its borders into three loops, the
    inside one free of the condition; exact."""
    x, b = te.placeholder((1, 6, size, size), name="x"), te.placeholder((6,), name="b")
    y = te.compute((1, 6, size + 2, size + 2), lambda n, c, h, w: tvm.tirx.if_then_else(
        tvm.tirx.all(1 <= h, h < size + 1, 1 <= w, w < size + 1), te.max(x[n, c, h - 1, w - 1] + b[c], 0.0), 0.0),
        name="y")
    func = schedule_cpu(te.create_prim_func([x, b, y]))
    assert len([name for name in _leaf_names(func) if name.startswith("y_")]) == 3
    lib = tvm.compile(tvm.IRModule({"main": func}), target=TARGET, tir_pipeline=PIPELINE)
    xv, bv = _rand(1, 6, size, size), _rand(6)
    out = tvm.runtime.tensor(np.full((1, 6, size + 2, size + 2), np.nan, np.float32))
    lib["main"](tvm.runtime.tensor(xv), tvm.runtime.tensor(bv), out)
    expected = np.pad(np.maximum(xv + bv[None, :, None, None], 0), ((0, 0), (0, 0), (1, 1), (1, 1)))
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-6)


def test_a_partitioned_block_leaves_the_stages_after_it_their_schedules():
    """A squeeze-excite's ReLU over 72 channels (whole vectors, then a tail partitioned off; 36 with AVX2's
    8 lanes), then a classifier GEMV in the same kernel (MobileNetV3-small): once TVM's loop_partition had
    run, the GEMV's rfactor failed and it ran scalar (1% of peak). The partitions now come after every rule:
    both blocks get their vectors, and the kernel stays exact."""
    channels = 9 * VECTOR // 2
    x, q = te.placeholder((1, channels, 1, 1), name="x"), te.placeholder((1, 576), name="q")
    w = te.placeholder((1024, 576), name="w")
    a = te.compute((1, channels, 1, 1), lambda n, c, h, v: te.max(x[n, c, h, v] + 1.0, 0.0), name="a")
    k = te.reduce_axis((0, 576), name="k")
    z = te.compute((1, 1024), lambda n, j: te.sum(q[n, k] * w[j, k], axis=k), name="z")
    func = schedule_cpu(te.create_prim_func([x, q, w, a, z]))
    vectorized = _vectorized_blocks(func)
    assert vectorized.get("a_n_c_h_v_fused0") and vectorized.get("z_rf_update"), vectorized
    lib = tvm.compile(tvm.IRModule({"main": func}), target=TARGET, tir_pipeline=PIPELINE)
    xv, qv, wv = _rand(1, channels, 1, 1), _rand(1, 576), _rand(1024, 576)
    outs = [tvm.runtime.tensor(np.full(shape, np.nan, np.float32)) for shape in ((1, channels, 1, 1), (1, 1024))]
    lib["main"](tvm.runtime.tensor(xv), tvm.runtime.tensor(qv), tvm.runtime.tensor(wv), *outs)
    np.testing.assert_allclose(outs[0].numpy(), np.maximum(xv + 1, 0), rtol=1e-6)
    np.testing.assert_allclose(outs[1].numpy(), qv @ wv.T, rtol=1e-4, atol=1e-3)


def _leaf_names(func) -> list[str]:
    return list(_vectorized_blocks_raw(func))


@pytest.mark.parametrize("shape", [(1, 58, 7, 7), (1, 116, 14, 14), (2, 3, 197), (1, 5, 1, 7)])
def test_elementwise_over_odd_maps_vectorizes_and_is_exact(shape):
    x, s = te.placeholder(shape, name="x"), te.placeholder((shape[1],), name="s")
    y = te.compute(shape, lambda n, c, *hw: x[(n, c, *hw)] * s[c] + 1.0, name="y")
    func = schedule_cpu(te.create_prim_func([x, s, y]))
    vectorized = _vectorized_blocks(func)
    assert vectorized and all(vectorized.values()), vectorized
    lib = tvm.compile(tvm.IRModule({"main": func}), target=TARGET, tir_pipeline=PIPELINE)
    xv, sv = _rand(*shape), _rand(shape[1])
    out = tvm.runtime.tensor(np.full(shape, np.nan, np.float32))
    lib["main"](tvm.runtime.tensor(xv), tvm.runtime.tensor(sv), out)
    expected = xv * sv.reshape((1, -1) + (1,) * (len(shape) - 2)) + 1.0
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows,length", [(12, 197), (6, 49), (3, 33), (4, 49 * VECTOR // 4)])
def test_ragged_sums_reduce_in_masked_lanes(rows, length):
    """A sum over a row no vector width divides (or only a quarter vector: 196 = 49 x 4, LeViT's softmax
    over 14 x 14 tokens, with 16 lanes; 98 with AVX2's 8): partial sums in VECTOR lanes, the last vector
    masked by the predicate rfactor drops (restored from its annotation); nothing read past the row."""
    x = te.placeholder((rows, length), name="x")
    r = te.reduce_axis((0, length), name="r")
    y = te.compute((rows,), lambda i: te.sum(tirx.exp(x[i, r]), axis=r), name="y")
    func = schedule_cpu(te.create_prim_func([x, y]))
    script = func.script()
    assert f"T.vectorized({VECTOR})" in script and f"T.where(" in script and RAGGED in script
    lib = tvm.compile(tvm.IRModule({"main": func}), target=TARGET, tir_pipeline=PIPELINE)
    # the row's neighbour in memory is huge: a read past the row would show
    xv = np.full((rows + 1, length), 1e30, np.float32)
    xv[:rows] = _rand(rows, length) * 0.1
    out = tvm.runtime.tensor(np.full((rows,), np.nan, np.float32))
    lib["main"](tvm.runtime.tensor(xv[:rows].copy()), out)
    np.testing.assert_allclose(out.numpy(), np.exp(xv[:rows]).sum(1), rtol=1e-5)


def test_a_global_pool_over_7x7_sums_the_flattened_map():
    x = te.placeholder((1, 24, 7, 7), name="x")
    rh, rw = te.reduce_axis((0, 7), name="rh"), te.reduce_axis((0, 7), name="rw")
    y = te.compute((1, 24, 1, 1), lambda n, c, i, j: te.sum(x[n, c, rh, rw], axis=[rh, rw]), name="y")
    func = schedule_cpu(te.create_prim_func([x, y]))
    assert all(_vectorized_blocks(func).values())
    lib = tvm.compile(tvm.IRModule({"main": func}), target=TARGET, tir_pipeline=PIPELINE)
    xv = _rand(1, 24, 7, 7)
    out = tvm.runtime.tensor(np.zeros((1, 24, 1, 1), np.float32))
    lib["main"](tvm.runtime.tensor(xv), out)
    np.testing.assert_allclose(out.numpy(), xv.sum((2, 3), keepdims=True), rtol=1e-5, atol=1e-5)


def test_a_max_over_a_ragged_row_keeps_the_plain_loop():
    """TVM's vectorizer scalarizes a predicated max; LLVM vectorizes the plain loop itself."""
    x = te.placeholder((4, 197), name="x")
    r = te.reduce_axis((0, 197), name="r")
    y = te.compute((4,), lambda i: te.max(x[i, r], axis=r), name="y")
    assert RAGGED not in schedule_cpu(te.create_prim_func([x, y])).script()


def test_a_lost_ragged_predicate_is_refused():
    """A RAGGED annotation on a block that is not rfactor's partial results cannot be restored: an error,
    never a block that reads past its row."""
    x = te.placeholder((4, 20), name="x")
    r = te.reduce_axis((0, 20), name="r")
    y = te.compute((4,), lambda i: te.sum(x[i, r], axis=r), name="y")
    sch = s_tir.Schedule(te.create_prim_func([x, y]))
    sch.annotate(sch.get_sblock("y"), RAGGED, [20, 16])
    with pytest.raises(souffle_py.SouffleError, match="ragged"):
        restore_ragged_predicates(sch.mod["main"])


# --- tiny ONNX graphs against ONNX Runtime ----------------------------------------------------------------

def _shufflenet_unit(channels: int, size: int):
    """ShuffleNetV2's stride-1 unit: split the channels in halves, the second through 1x1 conv + BN + ReLU,
    depthwise 3x3 + BN, 1x1 conv + BN + ReLU, concat with the first, shuffle the two groups (Reshape,
    Transpose, Reshape)."""
    half = channels // 2
    b = GraphBuilder("shuffle", seed=0, opset=17)
    x = b.input("x", [1, channels, size, size])
    left, right = b.node("Split", [x, b.const("split", np.array([half, half], np.int64))], outputs=2, axis=1)
    y = b.node("Relu", [conv_bn(b, right, "pw1", half, half, 1)])
    y = conv_bn(b, y, "dw", half, half, 3, groups=half)
    y = b.node("Relu", [conv_bn(b, y, "pw2", half, half, 1)])
    y = b.node("Concat", [left, y], axis=1)
    y = b.node("Reshape", [y, b.const("groups", np.array([1, 2, half, size, size], np.int64))])
    y = b.node("Transpose", [y], perm=[0, 2, 1, 3, 4])
    y = b.node("Reshape", [y, b.const("flat", np.array([1, channels, size, size], np.int64))])
    b.output(y, [1, channels, size, size])
    return b.model(), {"x": _rand(1, channels, size, size)}


@pytest.mark.parametrize("size", [7, 14])
def test_a_channel_shuffle_over_58_channels_matches_ort(size):
    model, feeds = _shufflenet_unit(116, size)
    assert_matches_ort(model, feeds)


@pytest.mark.parametrize("size", [7, 14])
def test_a_channel_shuffle_over_58_channels_moves_data_in_vectors(size):
    """With padded channel blocks (te_passes/channel_padding.py) the shuffle's last reshape reads the
    blocked map [N, C/32, H, W, 32] along its rows, 32 floats apart: a flat vector run with those loads
    gathered (flat.py), where it was one scalar per element (ShuffleNetV2's concats: 1.4 of 4.7 ms)."""
    model, feeds = _shufflenet_unit(116, size)
    compiled = souffle_py.optimize(model, quiet=True)
    moves = [name for name in _scalar_blocks(compiled) if "conv" not in name.lower()]
    assert not [name for name in moves if not re.search(r"pad|_init|_local$", name)], moves


def _elementwise_chain(shape):
    """x * a + b, hard-swish, times sigmoid(x): EfficientNet/MobileNetV3 activations over odd maps."""
    b = GraphBuilder("chain", seed=0, opset=17)
    x = b.input("x", list(shape))
    c = shape[1]
    y = b.node("Mul", [x, b.weight("scale", [1, c, 1, 1], 1.0)])
    y = b.node("Add", [y, b.weight("shift", [1, c, 1, 1], 1.0)])
    y = b.node("HardSwish", [y])
    y = b.node("Mul", [y, b.node("Sigmoid", [x])])
    b.output(y, list(shape))
    return b.model(), {"x": _rand(*shape) * 3}


@pytest.mark.parametrize("shape", [(1, 58, 7, 7), (1, 24, 14, 14), (1, 40, 14, 14)])
def test_elementwise_chains_and_hard_swish_over_rows_of_7_and_14(shape):
    model, feeds = _elementwise_chain(shape)
    assert_matches_ort(model, feeds)
    assert _scalar_blocks(souffle_py.optimize(model, quiet=True)) == []


@pytest.mark.parametrize("shape", [(1, 58, 7, 7), (1, 40, 14, 14), (2, 24, 7, 7)])
def test_global_average_pool_over_odd_maps(shape):
    b = GraphBuilder("gap", seed=0, opset=17)
    x = b.input("x", list(shape))
    b.output(b.node("GlobalAveragePool", [b.node("Relu", [x])]), [shape[0], shape[1], 1, 1])
    model = b.model()
    assert_matches_ort(model, {"x": _rand(*shape)})
    assert _scalar_blocks(souffle_py.optimize(model, quiet=True)) == []


@pytest.mark.parametrize("shape", [(1, 3, 7, 7), (1, 2, 14, 14), (1, 2, 49, 49), (1, 2, 5, 197), (1, 2, 6, 196)])
def test_softmax_over_odd_rows(shape):
    b = GraphBuilder("softmax", seed=0, opset=17)
    x = b.input("x", list(shape))
    b.output(b.node("Softmax", [b.node("Mul", [x, b.const("scale", np.float32(0.125))])], axis=-1), list(shape))
    model = b.model()
    assert_matches_ort(model, {"x": _rand(*shape) * 4})
    vectorized = {}
    for kernel in souffle_py.optimize(model, quiet=True).kernels:
        vectorized.update(_vectorized_blocks(schedule_cpu(kernel.func)))
    # the row maximum stays a plain loop, which LLVM vectorizes (flat.py); the sum of exponentials and the
    # normalization are vector code from 14 columns up
    if shape[-1] >= 14:
        assert sum(vectorized.values()) >= 1 + (shape[-1] >= 2 * VECTOR), vectorized


@pytest.mark.parametrize("rows,width", [(32, 7), (32, 14), (16, 49)])
def test_layer_norm_over_odd_rows(rows, width):
    b = GraphBuilder("layernorm", seed=0, opset=17)
    x = b.input("x", [1, rows, width])
    y = b.node("LayerNormalization", [x, b.weight("gamma", [width], 1.0), b.weight("beta", [width], 1.0)],
               axis=-1, epsilon=1e-5)
    b.output(y, [1, rows, width])
    assert_matches_ort(b.model(), {"x": _rand(1, rows, width)})


def test_a_dense_block_concat_feeds_a_conv():
    """DenseNet: BN + ReLU over the concat of the block's input and a new layer's 32 channels, then a 1x1
    conv; the concat selects by channel, so its vectors run over the map."""
    b = GraphBuilder("dense", seed=0, opset=17)
    x = b.input("x", [1, 40, 7, 7])
    new = b.node("Relu", [conv_bn(b, x, "grow", 40, 24, 3)])
    y = b.node("Concat", [x, new], axis=1)
    y = b.node("Relu", [conv_bn(b, b.node("Relu", [y]), "next", 64, 32, 1)])
    b.output(y, [1, 32, 7, 7])
    model = b.model()
    assert_matches_ort(model, {"x": _rand(1, 40, 7, 7)})


def test_a_window_sum_over_rows_of_56_reduces_in_output_lanes():
    """PoolFormer's 3x3 average pool, stride 1, over 56-wide rows: 16 lanes do not divide the row, 8 do; each
    tap is a contiguous load of 8 outputs' inputs (it was one scalar sum of 9 terms per output)."""
    x = te.placeholder((1, 8, 58, 58), name="x")
    r0, r1 = te.reduce_axis((0, 3), name="r0"), te.reduce_axis((0, 3), name="r1")
    y = te.compute((1, 8, 56, 56), lambda n, c, i, j: te.sum(x[n, c, i + r0, j + r1], axis=[r0, r1]), name="y")
    func = schedule_cpu(te.create_prim_func([x, y]))
    assert "T.vectorized(8)" in func.script() or VECTOR < 16
    lib = tvm.compile(tvm.IRModule({"main": func}), target=TARGET, tir_pipeline=PIPELINE)
    xv = _rand(1, 8, 58, 58)
    out = tvm.runtime.tensor(np.full((1, 8, 56, 56), np.nan, np.float32))
    lib["main"](tvm.runtime.tensor(xv), out)
    expected = sum(xv[:, :, a:a + 56, b:b + 56] for a in range(3) for b in range(3))
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-5)


def test_steps_that_need_the_stage_pipeline_run_before_every_partition():
    """A padded result's fold (ragged.inline_output_copy) and the epilogue fusion waiting for it are
    reverse_compute_inlines, which a partition's opaque blocks refuse ("not a stage pipeline"): at the close
    of partitions_last they run first, in the order registered, the partitions after (EdgeNeXt's attention
    GEMMs kept their padded copies behind a transpose's partition)."""
    from souffle_py.schedule.flat import partitions_last, when_scheduled

    order = []
    with partitions_last():
        when_scheduled("a", lambda: order.append("partition a"))
        when_scheduled("b", lambda: order.append("fold b"), "padded output inlining", "a copy", before_partitions=True)
        when_scheduled("c", lambda: order.append("partition c"))
        when_scheduled("b", lambda: order.append("epilogue b"), "tile epilogue fusion", "apart", before_partitions=True)
        assert order == []  # nothing runs before the close
    assert order == ["fold b", "epilogue b", "partition a", "partition c"]
    when_scheduled("d", lambda: order.append("now"))  # outside partitions_last: at once
    assert order[-1] == "now"


def test_a_step_for_a_block_computed_elsewhere_by_then_is_skipped():
    """A partition registered for an epilogue that a later step inlined into a GEMM's write-back (ConvNeXt-T
    int8: "the loop no longer exists", an error in strict mode) is skipped; one whose block is there runs."""
    from souffle_py.schedule.flat import partitions_last, when_scheduled

    x = te.placeholder((64,), name="x")
    y = te.compute((64,), lambda i: x[i] * 2.0, name="y")
    z = te.compute((64,), lambda i: y[i] + 1.0, name="z")
    sch = s_tir.Schedule(te.create_prim_func([x, z]))
    ran = []
    with partitions_last():
        when_scheduled("y", lambda: ran.append("y"), sch=sch)
        when_scheduled("z", lambda: ran.append("z"), sch=sch)
        sch.compute_inline(sch.get_sblock("y"))
    assert ran == ["z"]
