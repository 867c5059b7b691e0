"""schedule/default.py: the rule-based CPU schedules compute what the unscheduled TEs compute."""

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import te, tirx

from souffle_py.cpu_target import using
from souffle_py.schedule.blocks import block_kind, vector_lanes
from souffle_py.schedule.budgets import gemm_accumulators, gemm_tile_columns, gemm_tile_rows
from souffle_py.schedule.default import schedule_cpu
from souffle_py.schedule.rules.gemm_panel import register_tile
from souffle_py.schedule.threads import runs_on_one_thread
from souffle_py.target import resolve_target

TARGET = resolve_target("llvm")
VECTOR, TILE_J = vector_lanes(), gemm_tile_columns()  # the host's: what a test outside `using` compiles for
AVX2, AVX512 = "llvm -mcpu=haswell", "llvm -mcpu=sapphirerapids"  # 8 lanes, 16 registers; 16 lanes, 32


def _run(tensors, inputs):
    lib = tvm.compile(schedule_cpu(te.create_prim_func(tensors)), target=TARGET)
    out = tvm.runtime.tensor(np.full([int(d) for d in tensors[-1].shape], np.nan, np.float32))
    lib["main"](*[tvm.runtime.tensor(x) for x in inputs], out)
    return out.numpy()


def _rand(*shape):
    return np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("m,n,k", [(128, 96, 64), (7, 33, 5), (1, 1024, 64), (100, 1024, 32), (49, 48, 17),
                                   (13, 16, 40), (3, 2, 2)])
def test_gemm_any_shape(m, n, k):
    a, b = te.placeholder((m, k), name="a"), te.placeholder((k, n), name="b")
    r = te.reduce_axis((0, k), name="r")
    c = te.compute((m, n), lambda i, j: te.sum(a[i, r] * b[r, j], axis=r), name="c")
    x, y = _rand(m, k), _rand(k, n)
    np.testing.assert_allclose(_run([a, b, c], [x, y]), x @ y, rtol=1e-4, atol=1e-4)


def test_batch_axes_the_weights_ignore_become_rows():
    """[T, B, K] x [K, N]: one GEMM over T*B rows (an LSTM's input projection)."""
    x_t, w_t = te.placeholder((20, 1, 32), name="x"), te.placeholder((32, 64), name="w")
    r = te.reduce_axis((0, 32), name="r")
    y_t = te.compute((20, 1, 64), lambda t, b, g: te.sum(x_t[t, b, r] * w_t[r, g], axis=r), name="y")
    sch = tvm.s_tir.Schedule(schedule_cpu(te.create_prim_func([x_t, w_t, y_t])))
    assert "t_b_fused" in sch.mod["main"].script()
    x, w = _rand(20, 1, 32), _rand(32, 64)
    np.testing.assert_allclose(_run([x_t, w_t, y_t], [x, w]), x @ w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("target,rows", [(AVX512, 8), (AVX2, 4)])  # the 8 x 32 and 4 x 16 tiles (TILES)
def test_weight_axes_after_the_rows_become_one_column_axis(target, rows):
    """An einsum 'td,dnh->tnh' over a [d, n, h] weight: the heads n index only the weight, so n and h are
    the GEMM's columns and t its rows (before, n was taken as the rows: each t streamed the whole weight)."""
    x_t, w_t = te.placeholder((24, 16), name="x"), te.placeholder((16, 3, 32), name="w")
    r = te.reduce_axis((0, 16), name="r")
    y_t = te.compute((24, 3, 32), lambda t, n, h: te.sum(x_t[t, r] * w_t[r, n, h], axis=r), name="y")
    x, w = _rand(24, 16), _rand(16, 3, 32)
    with using(target):
        script = schedule_cpu(te.create_prim_func([x_t, w_t, y_t])).script()
        assert "n_h_fused" in script and f"T.unroll({rows})" in script  # rows of t in the register tile
        np.testing.assert_allclose(_run([x_t, w_t, y_t], [x, w]), np.einsum("td,dnh->tnh", x, w), rtol=1e-4,
                                   atol=1e-4)


def test_keys_read_across_channel_blocks_are_packed_before_the_scores():
    """Q K^T read straight from a conv's channel-blocked output (Visformer): a vector of keys would gather
    (32 floats apart). The map is packed with the token axes innermost, and the 196 columns, which no vector
    divides and no padded copy can take (Q and K read one buffer), run in 4-lane vectors."""
    x_t = te.placeholder((1, 18, 14, 14, 32), name="x")
    r = te.reduce_axis((0, 64), name="r")

    def head(h, n, d, first):
        c = first + h * 64 + d
        return x_t[0, c // 32, n // 14, n % 14, c % 32]
    s_t = te.compute((1, 3, 196, 196), lambda b, h, i, j: te.sum(head(h, i, r, 0) * head(h, j, r, 192), axis=r),
                     name="s")
    script = schedule_cpu(te.create_prim_func([x_t, s_t])).script()
    assert "x_global = T.sblock_alloc_buffer((1, 18, 32, 196))" in script and "T.vectorized(4)" in script
    x = _rand(1, 18, 14, 14, 32)
    channels = x.transpose(0, 1, 4, 2, 3).reshape(576, 196)
    expected = np.stack([channels[h * 64:(h + 1) * 64].T @ channels[192 + h * 64:256 + h * 64] for h in range(3)])
    np.testing.assert_allclose(_run([x_t, s_t], [x])[0], expected, rtol=1e-4, atol=1e-4)


def test_window_partition_reads_are_not_tiled_across_windows():
    """Swin's QKV GEMM reads through the window partition ((w, p) -> pixel with // and %): a register tile
    spanning two windows has no affine region, and fusing the window axis into the rows gave wrong values."""
    a_t, w_t = te.placeholder((1, 14, 14, 32), name="a"), te.placeholder((32, 64), name="w")
    r = te.reduce_axis((0, 32), name="r")
    c_t = te.compute((4, 49, 64), lambda w, p, j: te.sum(
        a_t[0, w // 2 * 7 + p // 7, w % 2 * 7 + p % 7, r] * w_t[r, j], axis=r), name="c")
    a, w = _rand(1, 14, 14, 32), _rand(32, 64)
    windows = a[0].reshape(2, 7, 2, 7, 32).transpose(0, 2, 1, 3, 4).reshape(4, 49, 32)
    np.testing.assert_allclose(_run([a_t, w_t, c_t], [a, w]), windows @ w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("length", [64, 48, 40, 16])
@pytest.mark.parametrize("reducer", ["sum", "max"])
def test_row_reductions(length, reducer):
    x_t = te.placeholder((6, length), name="x")
    r = te.reduce_axis((0, length), name="r")
    op = te.sum if reducer == "sum" else te.max
    y_t = te.compute((6,), lambda i: op(tirx.exp(x_t[i, r]), axis=r), name="y")
    sch = tvm.s_tir.Schedule(te.create_prim_func([x_t, y_t]))
    assert block_kind(sch, sch.get_sblock("y")) == "reduction"
    x = _rand(6, length)
    expected = np.exp(x).sum(1) if reducer == "sum" else np.exp(x).max(1)
    np.testing.assert_allclose(_run([x_t, y_t], [x]), expected, rtol=1e-5, atol=1e-5)


def test_long_rows_accumulate_vector_lanes():
    x_t = te.placeholder((4, 128), name="x")
    r = te.reduce_axis((0, 128), name="r")
    y_t = te.compute((4,), lambda i: te.sum(x_t[i, r], axis=r), name="y")
    assert f"T.vectorized({VECTOR})" in schedule_cpu(te.create_prim_func([x_t, y_t])).script()


TILES = {  # (rows, cols) -> the register tile: AVX-512's 20 accumulator registers, AVX2's 8
    AVX512: [(1, 1024, (1, 256)), (100, 1024, (5, 64)), (128, 768, (8, 32)), (49, 128, (7, 32)), (3, 48, (3, 16)),
             (16, 17, (8, 16)), (197, 64, (8, 32)), (197, 197, (8, 32))],
    AVX2: [(1, 1024, (1, 64)), (100, 1024, (4, 16)), (128, 768, (4, 16)), (49, 128, (4, 16)), (3, 48, (3, 16)),
           (16, 17, (4, 16)), (197, 64, (4, 16)), (197, 197, (4, 16))],
}


@pytest.mark.parametrize("target,rows,cols,tile", [(t, *case) for t, cases in TILES.items() for case in cases])
def test_register_tile_fills_the_accumulators(target, rows, cols, tile):
    with using(target):
        assert register_tile(rows, cols) == tile


@pytest.mark.parametrize("target", [AVX512, AVX2])
@pytest.mark.parametrize("rows,cols", [(1, 1024), (100, 1024), (128, 768), (49, 128), (3, 48), (16, 17), (5, 7)])
def test_register_tiles_are_whole_and_within_budget(target, rows, cols):
    """Whole tiles, except a masked last row tile where no row count from min(rows, 4) to the tile's rows
    divides the rows (AVX2's 4 rows over 49 or 5; AVX-512 takes 7 x 7)."""
    with using(target):
        lanes, budget, most = vector_lanes(), gemm_accumulators() * vector_lanes(), gemm_tile_rows()
        tile_i, tile_j = register_tile(rows, cols, masked_columns=False)
    divisible = any(rows % d == 0 for d in range(min(rows, 4), most + 1))
    assert (rows % tile_i == 0 or not divisible) and cols % tile_j == 0 and tile_i * tile_j <= budget
    assert tile_j == 1 or (tile_j % lanes == 0 and (tile_j // lanes) & (tile_j // lanes - 1) == 0)


@pytest.mark.parametrize("m,n,k", [(128, 4 * TILE_J, 64), (13, 2 * TILE_J, 24), (100, 8 * TILE_J, 16)])
def test_gemm_reading_packed_weight_panels(m, n, k):
    """W[j // P, k, j % P] (te_passes/layout.py): the tile keeps the panel width, the columns are chunked."""
    a, wp = te.placeholder((m, k), name="a"), te.placeholder((n // TILE_J, k, TILE_J), name="wp")
    r = te.reduce_axis((0, k), name="r")
    c = te.compute((m, n), lambda i, j: te.sum(a[i, r] * wp[j // TILE_J, r, j % TILE_J], axis=r), name="c")
    x, w = _rand(m, k), _rand(k, n)
    packed = np.ascontiguousarray(w.reshape(k, n // TILE_J, TILE_J).transpose(1, 0, 2))
    np.testing.assert_allclose(_run([a, wp, c], [x, packed]), x @ w, rtol=1e-4, atol=1e-4)
    assert f"T.vectorized({TILE_J})" in schedule_cpu(te.create_prim_func([a, wp, c])).script()


@pytest.mark.parametrize("target,rows,not_rows", [(AVX512, 7, 4), (AVX2, 4, 7)])
def test_rows_of_a_panel_tile_are_chosen_for_the_panel_width(target, rows, not_rows):
    """196 rows (Swin-B's 14 x 14 tokens) over 32-column panels (AVX-512): 7 rows (14 accumulators), not the
    4 rows of the 4 x 64 tile that the unpacked columns would allow (8 accumulators: Swin-B 162 -> 136 ms).
    AVX2's 8 accumulator registers hold 4 rows of its 16-column panels. Both run here (AVX2 is a subset)."""
    with using(target):
        panel = gemm_tile_columns()
        m, n, k = 196, 4 * panel, 16
        a, wp = te.placeholder((m, k), name="a"), te.placeholder((n // panel, k, panel), name="wp")
        r = te.reduce_axis((0, k), name="r")
        c = te.compute((m, n), lambda i, j: te.sum(a[i, r] * wp[j // panel, r, j % panel], axis=r), name="c")
        script = schedule_cpu(te.create_prim_func([a, wp, c])).script()
        assert f"T.unroll({rows})" in script and f"T.unroll({not_rows})" not in script
        x, w = _rand(m, k), _rand(k, n)
        packed = np.ascontiguousarray(w.reshape(k, n // panel, panel).transpose(1, 0, 2))
        np.testing.assert_allclose(_run([a, wp, c], [x, packed]), x @ w, rtol=1e-4, atol=1e-4)


def test_a_three_index_operand_that_is_not_a_panel_keeps_the_register_tile():
    """Attention's context matmul reads V[0, k, h * 64 + d] out of the fused QKV tensor: three indices, the
    reduction in the middle, but no panel; taking its width (2304) as the tile made BERT 200x slower."""
    p_t, v_t = te.placeholder((2, 16, 16), name="p"), te.placeholder((1, 16, 192), name="v")
    r = te.reduce_axis((0, 16), name="r")
    c_t = te.compute((2, 16, 64), lambda h, i, d: te.sum(p_t[h, i, r] * v_t[0, r, h * 64 + d + 64], axis=r), name="c")
    assert "T.vectorized(192)" not in schedule_cpu(te.create_prim_func([p_t, v_t, c_t])).script()
    p, v = _rand(2, 16, 16), _rand(1, 16, 192)
    expected = np.stack([p[h] @ v[0, :, h * 64 + 64:h * 64 + 128] for h in range(2)])
    np.testing.assert_allclose(_run([p_t, v_t, c_t], [p, v]), expected, rtol=1e-4, atol=1e-4)


def test_elementwise_kernels_are_vectorized_and_parallel_except_bool_stores():
    """Float element-wise kernels get the whole injective rule; a bool store stays scalar (LLVM's int8
    lanes do not store into a bool buffer) but keeps its parallel loop."""
    x = te.placeholder((64, 1024), name="x")
    y = te.compute((64, 1024), lambda i, j: x[i, j] * 2.0, name="y")
    mask = te.compute((64, 1024), lambda i, j: x[i, j] > 0.0, name="mask")
    floats = schedule_cpu(te.create_prim_func([x, y])).script()
    assert f"T.vectorized({VECTOR})" in floats and "T.parallel" in floats
    bools = schedule_cpu(te.create_prim_func([x, mask])).script()
    assert "T.vectorized" not in bools and "T.parallel" in bools
    tvm.compile(schedule_cpu(te.create_prim_func([x, mask])), target=TARGET)


def test_selects_between_halves_stay_scalar_and_right():
    """A rotary embedding as the vertical pass composes it: TVM's vectorizer miscompiled this select over
    a fused loop (values of 1e35), so loops with if_then_else stay scalar."""
    cos = te.placeholder((2, 3, 4), name="cos")
    x = te.placeholder((2, 3, 32), name="x")
    sin = te.placeholder((2, 3, 4), name="sin")

    def rotary(a, b, j):
        first = sin[a, b, j % 8] * x[a, b, j] - cos[a, b, j % 8] * x[a, b, j + 4]
        second = cos[a, b, j % 8 - 4] * x[a, b, j - 4] + sin[a, b, j % 8 - 4] * x[a, b, j]
        return tirx.if_then_else(4 <= j % 8, second, first)

    out = te.compute((2, 3, 32), rotary, name="out")
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal((2, 3, 4)).astype(np.float32), rng.standard_normal((2, 3, 32)).astype(np.float32),
              rng.standard_normal((2, 3, 4)).astype(np.float32)]
    c, xv, s = inputs
    j = np.arange(32)
    m = j % 8
    expected = np.where(m >= 4, c[..., np.clip(m - 4, 0, 3)] * xv[..., np.clip(j - 4, 0, 31)] + s[..., np.clip(m - 4, 0, 3)] * xv,
                        s[..., np.clip(m, 0, 3)] * xv - c[..., np.clip(m, 0, 3)] * xv[..., np.clip(j + 4, 0, 31)])
    np.testing.assert_allclose(_run([cos, x, sin, out], inputs), expected, rtol=1e-5, atol=1e-5)


def test_selects_by_row_vectorize_along_the_row_and_are_right():
    """Swin's shifted-window add picks its source by row and column while the vector runs along the
    channels: the condition is the same for every lane, so the row is vectorized (and exact)."""
    x = te.placeholder((14, 14, 64), name="x")
    y = te.placeholder((14, 14, 64), name="y")
    out = te.compute((14, 14, 64), lambda i, j, c: tirx.if_then_else(
        i >= 3, tirx.if_then_else(j >= 3, x[i - 3, j - 3, c], x[i - 3, j + 11, c]), x[i + 11, j, c]) + y[i, j, c],
        name="out")
    text = schedule_cpu(te.create_prim_func([x, y, out])).script()
    assert f"T.vectorized({VECTOR})" in text
    xv, yv = _rand(14, 14, 64), _rand(14, 14, 65)[..., :64].copy()
    rolled = np.concatenate([xv[11:], xv[:11]], axis=0)
    rolled = np.where(np.arange(14)[:, None, None] >= 3, np.concatenate([rolled[:, 11:], rolled[:, :11]], axis=1),
                      rolled)
    np.testing.assert_allclose(_run([x, y, out], [xv, yv]), rolled + yv, rtol=1e-6)


@pytest.mark.parametrize("shape,lanes", [((1, 8, 56, 56), VECTOR), ((2, 3, 4, 64), VECTOR),
                                         ((1, 4, 7, 7), VECTOR), ((1, 32, 1, 1), VECTOR), ((1, 3, 1, 7), 4)])
def test_injective_vectors_run_over_the_flattened_map(shape, lanes):
    """An NCHW map's elementwise work is vectorized over its flattened rows (h and w fused: 49 elements of a
    7 x 7 map are 3 vectors and a scalar tail, schedule/flat.py), the tail a loop of its own so that every
    vector loads contiguously."""
    x, s = te.placeholder(shape, name="x"), te.placeholder((shape[1],), name="s")
    y = te.compute(shape, lambda n, c, h, w: x[n, c, h, w] * s[c] + 1.0, name="y")
    func = schedule_cpu(te.create_prim_func([x, s, y]))
    loops = [l for l in _all_loops(func) if int(l.kind) == 2]  # ForKind.VECTORIZED
    assert [int(l.extent) for l in loops] == [lanes]
    xv, sv = _rand(*shape), _rand(shape[1])
    np.testing.assert_allclose(_run([x, s, y], [xv, sv]), xv * sv[None, :, None, None] + 1.0, rtol=1e-5, atol=1e-6)


def _all_loops(func):
    found = []
    tvm_ffi.structural_walk(func.body, [(tirx.For, found.append)])
    return found


def _vector_lanes_of_partials(func) -> list[int]:
    """Extents of the vectorized loops of rfactor partial-sum blocks ("..._rf_update")."""
    script = func.script()
    return [int(line.split("T.vectorized(")[1].split(")")[0]) for line, nxt in zip(script.splitlines(),
            script.splitlines()[1:]) if "T.vectorized(" in line and "_rf_update" in nxt]


def test_gemv_reading_a_transposed_weight_runs_dot_products_in_vector_lanes():
    """EfficientNet's classifier: [1, C, 1, 1] x W[N, C] read as W[j, k], N = 1000 has no column vector;
    the dot products along k are contiguous in both operands and run in VECTOR lanes (was a scalar chain)."""
    x_t, w_t = te.placeholder((1, 64, 1, 1), name="x"), te.placeholder((40, 64), name="w")
    r = te.reduce_axis((0, 64), name="r")
    y_t = te.compute((1, 40), lambda i, j: te.sum(x_t[0, r, 0, 0] * w_t[j, r], axis=r), name="y")
    assert _vector_lanes_of_partials(schedule_cpu(te.create_prim_func([x_t, w_t, y_t]))) == [VECTOR]
    x, w = _rand(1, 64, 1, 1), _rand(40, 64)
    np.testing.assert_allclose(_run([x_t, w_t, y_t], [x, w]), x.reshape(1, 64) @ w.T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("target,side,lanes", [(AVX512, 56, 8), (AVX512, 32, 16), (AVX512, 12, 16),
                                              (AVX2, 56, 8), (AVX2, 32, 8), (AVX2, 12, 4)])
def test_global_pools_accumulate_lanes_within_rows(target, side, lanes):
    """A global average pool reduces over (h, w) of an NCHW map: the row axis w is split into vector lanes
    of partial sums (8 for a 56-wide row, never across rows with a stride, which would gather); a row that
    only a quarter vector divides (12, AVX-512) is summed over the flattened map in whole vectors instead
    (flat.py: 144 = 9 vectors of 16, contiguous). To AVX2's 8 lanes 12 is a half vector: rows of 4 lanes."""
    x_t = te.placeholder((1, 24, side, side), name="x")
    rh, rw = te.reduce_axis((0, side), name="rh"), te.reduce_axis((0, side), name="rw")
    y_t = te.compute((1, 24, 1, 1), lambda n, c, i, j: te.sum(x_t[n, c, rh, rw] / (side * side), axis=[rh, rw]),
                     name="y")
    x = _rand(1, 24, side, side)
    with using(target):
        assert _vector_lanes_of_partials(schedule_cpu(te.create_prim_func([x_t, y_t]))) == [lanes]
        np.testing.assert_allclose(_run([x_t, y_t], [x]), x.mean(axis=(2, 3), keepdims=True), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("m,n", [(196, 4 * TILE_J), (13, 2 * TILE_J)])
def test_gemm_epilogue_is_computed_in_the_tile_write_back(m, n):
    """A bias add reading a GEMM's output alone (Swin's QKV projection) runs in the GEMM's write-back, over
    packed panels and over a masked last row tile alike."""
    k = 24
    a, wp = te.placeholder((m, k), name="a"), te.placeholder((n // TILE_J, k, TILE_J), name="wp")
    bias = te.placeholder((n,), name="bias")
    r = te.reduce_axis((0, k), name="r")
    c = te.compute((m, n), lambda i, j: te.sum(a[i, r] * wp[j // TILE_J, r, j % TILE_J], axis=r), name="c")
    out = te.compute((m, n), lambda i, j: c[i, j] + bias[j], name="bias_add")
    tensors = [a, wp, bias, out]
    assert 'T.sblock("bias_add")' not in schedule_cpu(te.create_prim_func(tensors)).script()
    x, w, b = _rand(m, k), _rand(k, n), _rand(n)
    packed = np.ascontiguousarray(w.reshape(k, n // TILE_J, TILE_J).transpose(1, 0, 2))
    np.testing.assert_allclose(_run_all(tensors, [x, packed, b])[-1], x @ w + b, rtol=1e-4, atol=1e-4)


def _run_all(tensors, inputs):
    """Every output of the function (those after `inputs`), computed."""
    lib = tvm.compile(schedule_cpu(te.create_prim_func(tensors)), target=TARGET)
    outs = [tvm.runtime.tensor(np.full([int(d) for d in t.shape], np.nan, np.float32)) for t in tensors[len(inputs):]]
    lib["main"](*[tvm.runtime.tensor(x) for x in inputs], *outs)
    return [o.numpy() for o in outs]


def test_short_dot_products_of_many_rows_keep_the_register_tile():
    """Swin's window scores Q K^T (49 x 49, 32 terms, K read transposed): no rfactor into dot products,
    which made Swin-B 25% slower; only one-row GEMVs run as vector-lane dot products."""
    q_t, k_t = te.placeholder((49, 32), name="q"), te.placeholder((49, 32), name="k")
    r = te.reduce_axis((0, 32), name="r")
    s_t = te.compute((49, 49), lambda i, j: te.sum(q_t[i, r] * k_t[j, r], axis=r), name="s")
    assert _vector_lanes_of_partials(schedule_cpu(te.create_prim_func([q_t, k_t, s_t]))) == []
    q, k = _rand(49, 32), _rand(49, 32)
    np.testing.assert_allclose(_run([q_t, k_t, s_t], [q, k]), q @ k.T, rtol=1e-4, atol=1e-4)


def test_channel_blocked_pad_keeps_its_columns_a_serial_loop():
    """A pad storing channel blocks: rows in parallel, each row's columns a serial loop of whole channel
    vectors (fused into the parallel loop, each vector decomposed the fused index again), values kept."""
    x = te.placeholder((1, 2, 6, 6, VECTOR), name="x")
    pad = te.compute((1, 2, 8, 8, VECTOR), lambda n, c, h, w, i: tirx.if_then_else(
        tirx.all(h >= 1, h < 7, w >= 1, w < 7), x[n, c, h - 1, w - 1, i] * 2.0, tirx.const(0.0, "float32")), name="pad")
    func = schedule_cpu(te.create_prim_func([x, pad]))
    kinds = [(int(l.kind), int(l.extent)) for l in _all_loops(func)]
    assert (0, 8) in kinds and (2, VECTOR) in kinds  # serial columns, one vector of channels each
    assert all(extent != 2 * 8 * 8 for _, extent in kinds)  # the columns are not fused with the rows
    xv = _rand(1, 2, 6, 6, VECTOR)
    expected = np.zeros((1, 2, 8, 8, VECTOR), np.float32)
    expected[:, :, 1:7, 1:7] = 2 * xv
    np.testing.assert_allclose(_run([x, pad], [xv]), expected, rtol=1e-6)


@pytest.mark.parametrize("side", [7, 14])
def test_pool_over_channel_blocks_reduces_in_output_lanes(side):
    """A global pool over a [1, C / 16, H, W, 16] map (strided along H and W, contiguous along channels):
    one vector of channels per load, summed over the map (672 x 14 x 14: 0.12 -> 0.024 ms)."""
    x = te.placeholder((1, 4, side, side, VECTOR), name="x")
    r2, r3 = te.reduce_axis((0, side), name="r2"), te.reduce_axis((0, side), name="r3")
    y = te.compute((1, 4 * VECTOR, 1, 1), lambda a, c, b, d: te.sum(
        x[a, c // VECTOR, r2, r3, c % VECTOR] * (1.0 / side / side), axis=[r2, r3]), name="pool")
    func = schedule_cpu(te.create_prim_func([x, y]))
    assert [int(l.extent) for l in _all_loops(func) if int(l.kind) == 2] == [VECTOR] * 3  # init, update, store
    xv = _rand(1, 4, side, side, VECTOR)
    expected = xv.mean(axis=(2, 3)).reshape(1, 4 * VECTOR, 1, 1)
    np.testing.assert_allclose(_run([x, y], [xv]), expected, rtol=1e-5, atol=1e-6)


def test_column_sums_reduce_in_output_lanes():
    x = te.placeholder((37, 4 * VECTOR), name="x")
    r = te.reduce_axis((0, 37), name="r")
    y = te.compute((1, 4 * VECTOR), lambda i, j: te.sum(x[r, j], axis=r), name="y")
    xv = _rand(37, 4 * VECTOR)
    np.testing.assert_allclose(_run([x, y], [xv]), xv.sum(axis=0, keepdims=True), rtol=1e-5, atol=1e-5)


def _gemm_func(rows: int, cols: int = 256, depth: int = 256):
    a_t = te.placeholder((rows, depth), name="a")
    b_t = te.placeholder((depth, cols), name="b")
    k = te.reduce_axis((0, depth), name="k")
    c_t = te.compute((rows, cols), lambda i, j: te.sum(a_t[i, k] * b_t[k, j], axis=k), name="c")
    return [a_t, b_t, c_t]


def test_a_model_of_little_work_runs_on_one_thread():
    """Under MODEL_WORK_MIN iterations and MODEL_BYTES_MIN bytes in all, nothing is parallel: a second
    thread would save microseconds and a preempted one would stall every launch (tiny BERT 0.05 -> 16-32
    ms beside one busy process)."""
    small = [te.create_prim_func(_gemm_func(16)), te.create_prim_func(_gemm_func(8))]  # 1M + 0.5M MACs
    assert runs_on_one_thread(small)
    assert not runs_on_one_thread(small + [te.create_prim_func(_gemm_func(64))])  # + 4M
    script = schedule_cpu(small[0], one_thread=True).script()
    assert "T.parallel" not in script and "T.vectorized" in script
    assert "T.parallel" in schedule_cpu(small[0]).script()
    lib = tvm.compile(schedule_cpu(small[0], one_thread=True), target=TARGET)
    a, b = _rand(16, 256), _rand(256, 256)
    out = tvm.runtime.tensor(np.zeros((16, 256), np.float32))
    lib["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(b), out)
    np.testing.assert_allclose(out.numpy(), a @ b, rtol=1e-4, atol=1e-4)


def test_a_small_model_streaming_megabytes_keeps_its_threads():
    """A classifier GEMV (1M multiply-adds over a 4 MB weight) is faster on two threads: memory, not
    arithmetic, is what they share out."""
    x_t = te.placeholder((1, 1024), name="x")
    w_t = te.placeholder((1000, 1024), name="w")
    k = te.reduce_axis((0, 1024), name="k")
    y_t = te.compute((1, 1000), lambda i, j: te.sum(x_t[i, k] * w_t[j, k], axis=k), name="y")
    assert not runs_on_one_thread([te.create_prim_func([x_t, w_t, y_t])])


def test_gemv_over_a_weight_read_across_columns_reduces_in_vector_lanes():
    """A classifier's W[j, k] with 1024 columns: dot products along k in vector lanes, not a column vector
    gathering W element by element."""
    x, w = te.placeholder((1, 576), name="x"), te.placeholder((1024, 576), name="w")
    r = te.reduce_axis((0, 576), name="r")
    y = te.compute((1, 1024), lambda i, j: te.sum(x[i, r] * w[j, r], axis=r), name="y")
    script = schedule_cpu(te.create_prim_func([x, w, y])).script()
    assert "y_rf" in script and f"T.vectorized({VECTOR})" in script
    xv, wv = _rand(1, 576), _rand(1024, 576)
    np.testing.assert_allclose(_run([x, w, y], [xv, wv]), xv @ wv.T, rtol=1e-4, atol=1e-4)
