"""schedule/ragged.py: tiles over extents that nothing divides (197 tokens, maps 71 or 17 wide) compute
what the unscheduled TEs compute, write nothing beyond their outputs, and keep whole vector tiles."""

import re

import numpy as np
import pytest
import tvm
from tvm import te

from souffle_py.cpu_target import using
from souffle_py.schedule.blocks import vector_lanes
from souffle_py.schedule.default import schedule_cpu
from souffle_py.schedule.rules.gemm_panel import register_tile
from souffle_py.schedule.ragged import LAST_TILE_APART, tile_rows
from souffle_py.target import resolve_target

TARGET = resolve_target("llvm")
GUARD = 4096  # floats after the output that no store may touch


def _run(tensors, inputs):
    """Outputs of the default schedule, written into a buffer followed by a guard of NaNs (checked)."""
    lib = tvm.compile(schedule_cpu(te.create_prim_func(tensors)), target=TARGET)
    shape = [int(d) for d in tensors[-1].shape]
    size = int(np.prod(shape))
    raw = np.full(size + GUARD + 16, np.nan, np.float32)
    start = (-raw.ctypes.data % 64) // 4  # TVM takes 64-byte aligned memory only
    backing = raw[start:start + size + GUARD]
    out = tvm.runtime.from_dlpack(backing[:size].reshape(shape))
    lib["main"](*[tvm.runtime.tensor(x) for x in inputs], out)
    assert np.isnan(backing[size:]).all(), "a store went past the output"
    return backing[:size].reshape(shape).copy()


def _rand(*shape):
    return np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("extent,most,tile", [(71, 14, (12, 71 / 6)), (17, 14, (9, 8.5)), (56, 14, (14, 14.0)),
                                              (35, 14, (12, 35 / 3)), (8, 14, (8, 8.0)), (197, 8, (8, 197 / 25))])
def test_tile_rows(extent, most, tile):
    assert tile_rows(extent, most) == pytest.approx(tile)


@pytest.mark.parametrize("heads,m,n,k", [(3, 197, 197, 64), (3, 197, 64, 197), (2, 17, 33, 8), (2, 50, 49, 16)])
def test_batched_gemm_with_ragged_rows_and_columns(heads, m, n, k):
    """Attention's scores and context over 197 tokens: every head's rows and columns, nothing past them."""
    a, b = te.placeholder((1, heads, m, k), name="a"), te.placeholder((1, heads, k, n), name="b")
    r = te.reduce_axis((0, k), name="r")
    c = te.compute((1, heads, m, n), lambda z, h, i, j: te.sum(a[z, h, i, r] * b[z, h, r, j], axis=r), name="c")
    x, y = _rand(1, heads, m, k), _rand(1, heads, k, n)
    np.testing.assert_allclose(_run([a, b, c], [x, y]), np.einsum("zhik,zhkj->zhij", x, y), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("target,tile", [("llvm -mcpu=sapphirerapids", (8, 32)), ("llvm -mcpu=haswell", (4, 16))])
def test_padded_gemm_computes_whole_vector_tiles(target, tile):
    """197 x 197 scores: the update is vectorized over two registers (of AVX-512 or of AVX2) and carries no
    predicate (the operands are padded copies); only the write-back stores are masked."""
    a, b = te.placeholder((197, 64), name="a"), te.placeholder((64, 197), name="b")
    r = te.reduce_axis((0, 64), name="r")
    c = te.compute((197, 197), lambda i, j: te.sum(a[i, r] * b[r, j], axis=r), name="c")
    with using(target):
        assert register_tile(197, 197) == tile
        script = schedule_cpu(te.create_prim_func([a, b, c])).script()
    update = script[script.index('T.sblock("c_update")'):]
    update = update[:update.index("T.sblock(", 10)]
    assert "T.where" not in update and f"T.vectorized({tile[1]})" in script


@pytest.mark.parametrize("tokens,heads,dim", [(50, 2, 16), (150, 3, 32)])
def test_scores_of_a_head_sliced_from_a_fused_projection_are_padded(tokens, heads, dim):
    """Whisper's attention scores: Q read at a computed index (its head's slice of a fused QKV projection)
    and keys no vector divides. pad_einsum refuses such a read; it is reindexed first, so the scores still
    run whole vector tiles (one column per step before: 16 GFLOP/s); exact, nothing stored past them."""
    qkv = te.placeholder((1, tokens, 3 * heads * dim), name="qkv")
    kt = te.compute((1, heads, dim, tokens), lambda a, h, d, t: qkv[0, t, h * dim + d + heads * dim], name="kt")
    r = te.reduce_axis((0, dim), name="r")
    s = te.compute((1, heads, tokens, tokens),
                   lambda a, h, i, j: te.sum(qkv[0, i, h * dim + r] * kt[a, h, r, j], axis=r), name="s")
    script = schedule_cpu(te.create_prim_func([qkv, s])).script()
    update = script[script.index('T.sblock("s_update")') - 300:script.index('T.sblock("s_update")')]
    assert any(int(lanes) >= vector_lanes() for lanes in re.findall(r"T\.vectorized\((\d+)\)", update)), update
    x = _rand(1, tokens, 3 * heads * dim)
    q = x[0, :, :heads * dim].reshape(tokens, heads, dim).transpose(1, 0, 2)
    k = x[0, :, heads * dim:2 * heads * dim].reshape(tokens, heads, dim).transpose(1, 0, 2)
    np.testing.assert_allclose(_run([qkv, s], [x])[0], q @ k.transpose(0, 2, 1), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("width,kernel,pads", [(73, (3, 3), (0, 0)), (17, (1, 7), (0, 3)), (17, (7, 1), (3, 0))])
def test_conv_over_prime_widths(width, kernel, pads):
    """Inception's 73 -> 71 stem conv and its 1x7 / 7x1 convs over 17 x 17 maps, channel-blocked."""
    cin, blocks, lanes = 8, 2, 16
    x = te.placeholder((1, cin, width + 2 * pads[0], width + 2 * pads[1]), name="x")
    w = te.placeholder((blocks, cin, *kernel, lanes), name="w")
    out_h, out_w = width + 2 * pads[0] - kernel[0] + 1, width + 2 * pads[1] - kernel[1] + 1
    rc, ry, rx = te.reduce_axis((0, cin), "rc"), te.reduce_axis((0, kernel[0]), "ry"), te.reduce_axis((0, kernel[1]), "rx")
    y = te.compute((1, blocks, out_h, out_w, lanes),
                   lambda n, cb, i, j, ci: te.sum(x[n, rc, i + ry, j + rx] * w[cb, rc, ry, rx, ci], axis=[rc, ry, rx]),
                   name="y")
    xv, wv = _rand(*[int(d) for d in x.shape]), _rand(*[int(d) for d in w.shape])
    windows = np.lib.stride_tricks.sliding_window_view(xv[0], kernel, axis=(1, 2))  # [c, oh, ow, kh, kw]
    expected = np.einsum("cijyx,bcyxl->bijl", windows, wv)[None]
    np.testing.assert_allclose(_run([x, w, y], [xv, wv]), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("width", [147, 73])
def test_a_masked_last_column_tile_runs_apart(width):
    """A channel-blocked 3x3 conv over a map no tile divides (Inception-v3's 147 x 147; 73): the loop over
    column tiles stops before the masked last tile, which runs as a copy of the tile with its mask
    constant (LLVM spilled the partial sums of a tile masked inside the reduction: 1.7x slower)."""
    x = te.placeholder((1, 1, width + 2, width + 2, 32), name="x")
    w = te.placeholder((1, 32, 3, 3, 32), name="w")
    rc, ry, rx = te.reduce_axis((0, 32), "rc"), te.reduce_axis((0, 3), "ry"), te.reduce_axis((0, 3), "rx")
    y = te.compute((1, 1, width, width, 32), lambda n, cb, i, j, ci: te.sum(
        x[n, 0, i + ry, j + rx, rc] * w[cb, rc, ry, rx, ci], axis=[rc, ry, rx]), name="y")
    script = schedule_cpu(te.create_prim_func([x, w, y])).script()
    assert script.count('T.sblock("y_update")') == 2 and LAST_TILE_APART not in script
    xv, wv = _rand(*[int(d) for d in x.shape]), _rand(*[int(d) for d in w.shape])
    windows = np.lib.stride_tricks.sliding_window_view(xv[0, 0], (3, 3), axis=(0, 1))  # [oh, ow, c, kh, kw]
    expected = np.einsum("ijcyx,cyxl->ijl", windows, wv[0])[None, None]
    np.testing.assert_allclose(_run([x, w, y], [xv, wv]), expected, rtol=1e-4, atol=1e-3)



def test_a_padded_result_folds_into_its_write_back_once_every_rule_has_run():
    """ragged.inline_output_copy waits for the close of flat.partitions_last, as loop partitions do: the
    write-back's predicated store leaves the function no stage pipeline, and a later block's tiles
    (cache_write, reverse_compute_at) were refused (EdgeNeXt int8: each int8 GEMM after a padded one, in
    strict mode an error). The copy is there until the rules are done, folded after; values unchanged."""
    from tvm import s_tir
    from souffle_py.schedule.flat import partitions_last
    from souffle_py.schedule.rules.gemm_panel import schedule_gemm

    a, b = te.placeholder((197, 64), name="a"), te.placeholder((64, 197), name="b")
    r = te.reduce_axis((0, 64), name="r")
    c = te.compute((197, 197), lambda i, j: te.sum(a[i, r] * b[r, j], axis=r), name="c")
    sch = s_tir.Schedule(te.create_prim_func([a, b, c]))
    with using("llvm -mcpu=haswell"), partitions_last():
        schedule_gemm(sch, sch.get_sblock("c"))
        pending = sch.mod.script()
    after = sch.mod.script()
    assert pending.count("T.sblock(") == after.count("T.sblock(") + 1  # the copy, folded at the close
    x, y = _rand(197, 64), _rand(64, 197)
    lib = tvm.compile(sch.mod, target=TARGET)
    out = tvm.runtime.tensor(np.zeros((197, 197), np.float32))
    lib["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(y), out)
    np.testing.assert_allclose(out.numpy(), x @ y, rtol=1e-4, atol=1e-4)
