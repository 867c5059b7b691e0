"""schedule/conv.py: the default conv rule's register tiles, filter sets, output-channel block order and
epilogue, computing what the unscheduled TEs compute."""

import math

import numpy as np
import pytest
import tvm
from tvm import te

from souffle_py.cpu_target import using
from souffle_py.schedule.rules import conv_tile as conv_rules
from souffle_py.schedule.conv import VARIANT, Variant, conv_accumulator_lanes, conv_window_accumulators
from souffle_py.schedule.default import schedule_cpu
from souffle_py.target import resolve_target
from tests.test_cpu_target import HASWELL, SPR
from tests.test_schedule_default import _rand, _run, _run_all

# The tiles these tests name were measured with AVX-512 (16 lanes, 32 registers: a 32-channel block is two
# vectors), so they schedule for it (`using(SPR)`) whatever the host; the values are computed with code for
# the host (_run compiles for "llvm"), which runs the same loops in its own vectors.


@pytest.mark.parametrize("target,channels,chunked", [(SPR, 16, False), (SPR, 2048, False), (SPR, 4096, True),
                                                    (HASWELL, 2048, False), (HASWELL, 4096, True)])
def test_dense_conv_iterates_output_channel_blocks_innermost(target, channels, chunked):
    """A dense 1x1 conv: the blocks of output channels are the innermost outer loop (a tile's input rows
    stay in L1 for every block), in chunks whose weights fit in L2 when there are many input channels and
    the weights are CHUNK_MIN_WEIGHT_BYTES or more (2048 channels: 512 KB, read whole: each chunk would
    read the input map again). AVX2 chunks alike; over 16 channels its 3-column tile does not divide the 8
    columns (a masked tile: a column loop inside the blocks'), AVX-512's 4 do."""
    x_t = te.placeholder((1, channels, 8, 8), name="x")
    w_t = te.placeholder((2, channels, 1, 1, 32), name="w")
    rc, r0, r1 = (te.reduce_axis((0, e), name=n) for n, e in (("rc", channels), ("r0", 1), ("r1", 1)))
    y_t = te.compute((1, 64, 8, 8), lambda n, f, i, j: te.sum(
        x_t[n, rc, i + r0, j + r1] * w_t[f // 32, rc, r0, r1, f % 32], axis=[rc, r0, r1]), name="conv")
    x, w = _rand(1, channels, 8, 8), _rand(2, channels, 1, 1, 32)
    weight = w.transpose(0, 4, 1, 2, 3).reshape(64, channels)
    with using(target):
        script = schedule_cpu(te.create_prim_func([x_t, w_t, y_t])).script()
        parallel = [line for line in script.splitlines() if "T.parallel" in line][0]
        assert ("f_0_0_n_i_j_0_f_0_1_fused" if chunked else "n_i_j_0_f_0_fused") in parallel
        np.testing.assert_allclose(_run([x_t, w_t, y_t], [x, w]), np.einsum("fc,nchw->nfhw", weight, x),
                                   rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("channels,rows", [(64, 14), (16, 7)])
def test_dense_conv_over_long_reductions_takes_wider_register_tiles(channels, rows):
    """A blocked 1x1 conv broadcasts one input value per column: over 64 channels its tile is 32 channels by
    14 columns (28 accumulators); over 16 channels it keeps 7 columns (wider was slower there)."""
    x_t = te.placeholder((1, channels // 16, 14, 14, 16), name="x")
    w_t = te.placeholder((2, channels, 1, 1, 32), name="w")
    rc, r0, r1 = (te.reduce_axis((0, e), name=n) for n, e in (("rc", channels), ("r0", 1), ("r1", 1)))
    y_t = te.compute((1, 2, 14, 14, 32), lambda n, fb, i, j, fi: te.sum(
        x_t[n, rc // 16, i + r0, j + r1, rc % 16] * w_t[fb, rc, r0, r1, fi], axis=[rc, r0, r1]), name="conv")
    x, w = _rand(1, channels // 16, 14, 14, 16), _rand(2, channels, 1, 1, 32)
    plain = x.transpose(0, 1, 4, 2, 3).reshape(1, channels, 14, 14)
    expected = np.einsum("fck,nchw->nfhwk", w[:, :, 0, 0, :], plain)
    with using(SPR):
        script = schedule_cpu(te.create_prim_func([x_t, w_t, y_t])).script()
        assert f"T.unroll({rows})" in script
        np.testing.assert_allclose(_run([x_t, w_t, y_t], [x, w]), expected, rtol=1e-4, atol=1e-3)


def _blocked_pointwise(channels: int, filters: int, side: int, block: int):
    """A 1x1 conv over a [1, C / b, side, side, b] map, weights [F / b, C, 1, 1, b]: its tensors, and a check
    of `func`'s values against numpy."""
    x_t = te.placeholder((1, channels // block, side, side, block), name="x")
    w_t = te.placeholder((filters // block, channels, 1, 1, block), name="w")
    rc, r0, r1 = (te.reduce_axis((0, e), name=n) for n, e in (("rc", channels), ("r0", 1), ("r1", 1)))
    y_t = te.compute((1, filters // block, side, side, block), lambda n, fb, i, j, fi: te.sum(
        x_t[n, rc // block, i + r0, j + r1, rc % block] * w_t[fb, rc, r0, r1, fi], axis=[rc, r0, r1]), name="conv")

    def check_values():
        x, w = _rand(1, channels // block, side, side, block), _rand(filters // block, channels, 1, 1, block)
        plain = x.transpose(0, 1, 4, 2, 3).reshape(1, channels, side, side)
        expected = np.einsum("fck,nchw->nfhwk", w[:, :, 0, 0, :], plain)
        np.testing.assert_allclose(_run([x_t, w_t, y_t], [x, w]), expected, rtol=1e-4, atol=1e-3)
    return [x_t, w_t, y_t], check_values


def _unrolled_extents(script: str, window: bool = False) -> list[int]:
    """The extents of the unrolled loops of a scheduled function's text, initializations left out, and the
    kernel window's loops (r0, r1) unless `window`."""
    return [int(line.split("T.unroll(")[1].split(")")[0]) for line in script.splitlines()
            if "T.unroll(" in line and "init" not in line
            and (window or line.split("for ")[1].split(" in")[0] not in ("r0", "r1"))]


@pytest.mark.parametrize("block,filters,sets", [(16, 192, 3), (16, 64, 2), (32, 64, 1)])
def test_short_rows_tile_several_output_channel_blocks(block, filters, sets):
    """Over a 7 x 7 map a 16-channel tile keeps 7 partial sums: it spans as many output-channel blocks as
    fit the registers (MLAS's filter sets); a 32-channel tile (14 partial sums) spans one, and so does the
    variant of fewer partial sums."""
    tensors, check_values = _blocked_pointwise(128, filters, 7, block)
    with using(SPR):
        script = schedule_cpu(te.create_prim_func(tensors)).script()
        assert _unrolled_extents(script)[0] == (sets if sets > 1 else 7)
        token = VARIANT.set(Variant(conv_accumulator_lanes=conv_accumulator_lanes()))  # the variant measured against it
        try:
            fewer = schedule_cpu(te.create_prim_func(tensors)).script()
        finally:
            VARIANT.reset(token)
        assert _unrolled_extents(fewer)[0] == 7
        check_values()


@pytest.mark.parametrize("block,blocks,side,tile", [(16, 12, 14, (3, 7)), (16, 4, 28, (4, 4)), (32, 4, 35, (2, 5)),
                                                    (32, 4, 28, (2, 6))])
def test_filter_sets_trade_columns_for_blocks_where_loads_drop(block, blocks, side, tile):
    """A 16-channel tile of 14 columns loads 15 vectors for 14 FMAs: 7 columns x 3 blocks load 10 for 21.
    A 32-channel tile of 14 columns does 28 FMAs for 16 loads: over 28 columns it takes 6 columns x 2 blocks
    (24 for 10), the last of its column tiles masked, and over 35 columns 5 x 2."""
    tensors, check_values = _blocked_pointwise(blocks * block, blocks * block, side, block)
    with using(SPR):
        script = schedule_cpu(te.create_prim_func(tensors)).script()
        assert tuple(_unrolled_extents(script)[:len(tile)]) == tile
        check_values()


def _blocked_3x3(channels: int, filters: int, side: int, stride: int = 1):
    """A 3x3 conv over a padded [1, C / 32, in, in, 32] map (in = (side - 1) * stride + 3), weights
    [F / 32, C, 3, 3, 32]: its tensors, and a check of the scheduled function's values against numpy."""
    size = (side - 1) * stride + 3
    x_t = te.placeholder((1, channels // 32, size, size, 32), name="x")
    w_t = te.placeholder((filters // 32, channels, 3, 3, 32), name="w")
    rc, r0, r1 = (te.reduce_axis((0, e), name=n) for n, e in (("rc", channels), ("r0", 3), ("r1", 3)))
    y_t = te.compute((1, filters // 32, side, side, 32), lambda n, fb, i, j, fi: te.sum(
        x_t[n, rc // 32, i * stride + r0, j * stride + r1, rc % 32] * w_t[fb, rc, r0, r1, fi], axis=[rc, r0, r1]),
        name="conv")

    def check_values():
        x, w = _rand(1, channels // 32, size, size, 32), _rand(filters // 32, channels, 3, 3, 32)
        plain = x.transpose(0, 1, 4, 2, 3).reshape(1, channels, size, size)
        windows = np.lib.stride_tricks.sliding_window_view(plain, (3, 3), axis=(2, 3))  # n, c, i, j, r0, r1
        windows = windows[:, :, ::stride, ::stride]
        expected = np.einsum("fcrsk,ncijrs->nfijk", w, windows)
        np.testing.assert_allclose(_run([x_t, w_t, y_t], [x, w]), expected, rtol=1e-4, atol=1e-3)
    return [x_t, w_t, y_t], check_values


@pytest.mark.parametrize("side,tile", [(13, (2, 5)), (14, (2, 5)), (7, (7,))])
def test_a_conv_window_that_llvm_unrolls_bounds_the_partial_sums(side, tile):
    """A 3x3 conv over 32-channel blocks: LLVM unrolls its 3-tap window and keeps each tap's weight vectors
    live, so 13 or 14 columns of partial sums (26-28 registers, as a 1x1 conv takes) spill: its tile keeps
    at most CONV_WINDOW_ACCUMULATORS registers of partial sums (5 columns x 2 blocks; 7 columns over a 7 x 7 map)."""
    tensors, check_values = _blocked_3x3(64, 256, side)
    with using(SPR):
        script = schedule_cpu(te.create_prim_func(tensors)).script()
        assert tuple(_unrolled_extents(script)[:len(tile)]) == tile
        assert math.prod(tile) * 2 <= conv_window_accumulators()
        check_values()


@pytest.mark.parametrize("stride", [1, 2])
def test_a_conv_window_is_unrolled_where_its_tile_keeps_its_registers(stride):
    """A 3x3 conv's window unrolled in the schedule (LLVM left windows loops; unrolled they ran 5-13% faster)
    where the tile's partial sums, a tap's weights and the inputs its taps share fit taps_unrolled_registers():
    6 columns x 2 blocks at stride 1 (24 + 4 + 8 inputs); at stride 2 it needs 13 inputs, LLVM spilled, so the
    window stays a loop. Exact either way."""
    tensors, check_values = _blocked_3x3(64, 128, 28, stride)
    with using(SPR):
        script = schedule_cpu(te.create_prim_func(tensors)).script()
        assert _unrolled_extents(script)[:2] == [2, 6]  # 2 blocks x 6 columns
        assert (_unrolled_extents(script, window=True)[:2] == [3, 3]) == (stride == 1)
        check_values()


def test_a_depthwise_window_is_unrolled_where_its_tile_keeps_its_registers():
    """A depthwise 3x3 over 16-channel blocks at 14 x 14: 14 columns of one vector, a tap's weight vector and
    the 16 input vectors its taps share (31 registers): its window unrolled (10-25% faster than LLVM's loop
    over kh). Exact."""
    x_t = te.placeholder((1, 2, 16, 16, 16), name="x")
    w_t = te.placeholder((2, 1, 3, 3, 16), name="w")
    rc, r0, r1 = (te.reduce_axis((0, e), name=n) for n, e in (("rc", 1), ("r0", 3), ("r1", 3)))  # as lowered
    y_t = te.compute((1, 2, 14, 14, 16), lambda n, cb, i, j, ci: te.sum(
        x_t[n, cb, i + r0, j + r1, ci] * w_t[cb, rc, r0, r1, ci], axis=[rc, r0, r1]), name="conv")
    script = schedule_cpu(te.create_prim_func([x_t, w_t, y_t])).script()
    assert _unrolled_extents(script, window=True)[:2] == [3, 3]
    x, w = _rand(1, 2, 16, 16, 16), _rand(2, 1, 3, 3, 16)
    windows = np.lib.stride_tricks.sliding_window_view(x, (3, 3), axis=(2, 3))  # n, cb, i, j, ci, r0, r1
    expected = np.einsum("nbijcrs,brsc->nbijc", windows, w[:, 0])
    np.testing.assert_allclose(_run([x_t, w_t, y_t], [x, w]), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("uneven", [True, False])
def test_filter_sets_need_not_divide_the_blocks(uneven, monkeypatch):
    """GoogLeNet's 112 -> 224 3x3 at 14 x 14: 7 blocks of 32 channels, a prime, allowed only one-block tiles
    of 7 columns (14 FMAs for 9 loads); in sets of 2 + 2 + 2 + 1 blocks (the last masked, run apart) it takes
    5 columns x 2 blocks (20 for 9). Exact either way."""
    monkeypatch.setattr(conv_rules, "UNEVEN_FILTER_SETS", uneven)
    tensors, check_values = _blocked_3x3(64, 224, 14)
    with using(SPR):
        script = schedule_cpu(te.create_prim_func(tensors)).script()
        assert tuple(_unrolled_extents(script)[:2]) == ((2, 5) if uneven else (7,))
        check_values()


@pytest.mark.parametrize("conv_is_output", [False, True])
def test_conv_epilogue_is_computed_in_the_tile_write_back(conv_is_output):
    """A residual add + ReLU reading a conv's output alone runs in the conv's write-back (no block, no
    intermediate map of its own); where the conv's output is also the function's, both stay."""
    x_t = te.placeholder((1, 2, 7, 7, 32), name="x")
    w_t = te.placeholder((2, 64, 1, 1, 32), name="w")
    rc, r0, r1 = (te.reduce_axis((0, e), name=n) for n, e in (("rc", 64), ("r0", 1), ("r1", 1)))
    conv = te.compute((1, 2, 7, 7, 32), lambda n, fb, i, j, fi: te.sum(
        x_t[n, rc // 32, i + r0, j + r1, rc % 32] * w_t[fb, rc, r0, r1, fi], axis=[rc, r0, r1]), name="conv")
    relu = te.compute(conv.shape, lambda *i: te.max(conv(*i) + x_t(*i), 0.0), name="relu")
    tensors = [x_t, w_t, conv, relu] if conv_is_output else [x_t, w_t, relu]
    script = schedule_cpu(te.create_prim_func(tensors)).script()
    assert ('T.sblock("relu")' in script) == conv_is_output
    x, w = _rand(1, 2, 7, 7, 32), _rand(2, 64, 1, 1, 32)
    plain = x.transpose(0, 1, 4, 2, 3).reshape(1, 64, 7, 7)
    expected = np.maximum(np.einsum("fck,nchw->nfhwk", w[:, :, 0, 0, :], plain) + x, 0)
    np.testing.assert_allclose(_run_all(tensors, [x, w])[-1], expected, rtol=1e-4, atol=1e-3)


def test_a_conv_over_channel_blocks_reads_them_without_division():
    """x[0, rc // 32, .., rc % 32]: the channel loop is split at the block, so the lowered loop indexes each
    block and each channel directly (LLVM kept the division there: a ResNet 3x3 conv 110 against 174
    GFLOP/s on a core); exact."""
    from tests.test_staged import blocked_conv_then_relu
    func = blocked_conv_then_relu()
    scheduled = schedule_cpu(func)
    script = scheduled.script()
    update = script[script.index('T.sblock("conv_update")'):]
    update = update[:update.index("T.reads")]
    assert "T.axis.reduce(64, rc_0 * 32 + rc_1)" in update, update  # a block loop and a channel loop
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 2, 10, 10, 32)).astype("float32")
    w = rng.standard_normal((1, 64, 3, 3, 32)).astype("float32")
    lib = tvm.compile(tvm.IRModule({"main": scheduled}), target=resolve_target("llvm"))
    out = tvm.runtime.empty((1, 1, 8, 8, 32), "float32")
    lib["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(w), out)
    xs = x.transpose(0, 1, 4, 2, 3).reshape(64, 10, 10)
    expected = np.zeros((8, 8, 32), np.float32)
    for r0 in range(3):
        for r1 in range(3):
            expected += np.einsum("chw,cf->hwf", xs[:, r0:r0 + 8, r1:r1 + 8], w[0, :, r0, r1, :])
    np.testing.assert_allclose(out.numpy()[0, 0], np.maximum(expected, 0), rtol=1e-4, atol=1e-4)
