"""schedule/streaming.py with the conv rule that marks it (default.py): a dense conv over a small map whose
weights exceed L2 reduces its input channels in pieces, each tile prefetching its block's next piece, and
computes what the TE computes; other convs and unmarked functions are left as they are."""

import re

import numpy as np
import pytest
import tvm
from tvm import s_tir, te

from souffle_py.cpu_target import using
from souffle_py.schedule.default import schedule_blocks, schedule_cpu
from souffle_py.schedule import streaming
from souffle_py.schedule.streaming import AT, PIECE, inject_weight_prefetch, stream_piece, streams_weights
from souffle_py.target import resolve_target
from tests.test_cpu_target import SPR

TARGET = resolve_target("llvm")  # the host: the values are computed with code it runs


@pytest.fixture(autouse=True)
def _two_threads(monkeypatch):
    """Whether chunks stream depends on how evenly they share the threads: these cases assume two."""
    monkeypatch.setattr(streaming, "num_threads", lambda: 2)


@pytest.mark.parametrize("chunks,threads,streamed", [(4, 2, True), (5, 2, False), (11, 2, True), (5, 1, True),
                                                     (8, 3, False), (16, 16, True), (2, 1, False)])
def test_chunks_stream_only_when_they_share_the_threads_evenly(monkeypatch, chunks, threads, streamed):
    """Streamed, a conv runs its chunks in parallel and nothing else: Inception-v3's 160 -> 160 1x7 convs
    in 5 chunks kept one of two threads busy for 3 while the other did 2 (0.71 ms; not streamed 0.61)."""
    monkeypatch.setattr(streaming, "num_threads", lambda: threads)
    assert (stream_piece(1024, chunks, 4096) > 0) == streamed


def _conv(channels: int, filters: int, side: int, block: int = 32):
    """A 1x1 conv over a channel-blocked [1, C / b, side, side, b] map, weights [F / b, C, 1, 1, b]."""
    x_t = te.placeholder((1, channels // block, side, side, block), name="x")
    w_t = te.placeholder((filters // block, channels, 1, 1, block), name="w")
    rc, r0, r1 = (te.reduce_axis((0, e), name=n) for n, e in (("rc", channels), ("r0", 1), ("r1", 1)))
    y_t = te.compute((1, filters // block, side, side, block), lambda n, fb, i, j, fi: te.sum(
        x_t[n, rc // block, i + r0, j + r1, rc % block] * w_t[fb, rc, r0, r1, fi], axis=[rc, r0, r1]), name="conv")
    relu = te.compute(y_t.shape, lambda *i: te.max(y_t(*i), 0.0), name="relu")
    return te.create_prim_func([x_t, w_t, relu])


def _expected(x, w):
    block = x.shape[-1]
    plain = x.transpose(0, 1, 4, 2, 3).reshape(1, x.shape[1] * block, *x.shape[2:4])
    return np.maximum(np.einsum("fck,nchw->nfhwk", w[:, :, 0, 0, :], plain), 0)


def _rand(*shape):
    return np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("channels,filters,side,streamed", [
    (512, 512, 7, True),     # 1 MB of weights over 7 x 7: four chunks, pieces of 128 channels
    (640, 256, 4, True),     # pieces of 128 of 640 channels (five)
    (512, 512, 28, False),   # a 28 x 28 map reuses each weight enough: the whole reduction per tile
    (64, 64, 7, False),      # weights within L2: nothing to stream
])
def test_streamed_convs_prefetch_and_compute_the_conv(channels, filters, side, streamed):
    """AVX-512's tiles (SPR) of 32-channel blocks, two vectors: one block per tile over these maps."""
    with using(SPR):
        func = schedule_cpu(_conv(channels, filters, side))
    script = func.script()
    assert ("T.prefetch" in script) == streamed
    assert PIECE not in script and AT not in script  # the marks are consumed
    assert 'T.sblock("relu")' not in script  # the epilogue still runs in the write-back
    x, w = _rand(1, channels // 32, side, side, 32), _rand(filters // 32, channels, 1, 1, 32)
    lib = tvm.compile(func, target=TARGET)
    out = tvm.runtime.tensor(np.full((1, filters // 32, side, side, 32), np.nan, np.float32))
    lib["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(w), out)
    np.testing.assert_allclose(out.numpy(), _expected(x, w), rtol=1e-4, atol=1e-3)


def test_filter_sets_prefetch_each_block_and_compute_the_conv():
    """16-channel blocks over a 7 x 7 map: each tile spans two blocks (14 partial sums, not 7), and each
    block's next piece is prefetched (a loop over the tile's blocks around the prefetch). AVX-512's tiles (SPR):
    a block is one vector."""
    with using(SPR):
        func = schedule_cpu(_conv(1152, 320, 7, block=16))
    script = func.script()
    assert "T.unroll(2)" in script and "T.unroll(7)" in script
    assert re.search(r"for fb_1, prefetch_line in T.grid\(2, \d+\)", script)
    x, w = _rand(1, 1152 // 16, 7, 7, 16), _rand(320 // 16, 1152, 1, 1, 16)
    lib = tvm.compile(func, target=TARGET)
    out = tvm.runtime.tensor(np.full((1, 320 // 16, 7, 7, 16), np.nan, np.float32))
    lib["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(w), out)
    np.testing.assert_allclose(out.numpy(), _expected(x, w), rtol=1e-4, atol=1e-3)


def test_prefetch_addresses_stay_inside_the_weights():
    """The last piece of the last block prefetches no further than the buffer's end (clamped). AVX-512's tiles
    (SPR), which stream these 32-channel blocks."""
    with using(SPR):
        script = schedule_cpu(_conv(512, 512, 7)).script()
    assert f"{512 * 512 - 1})" in script  # T.min(..., elements - 1)


def test_unmarked_functions_are_unchanged():
    func = _conv(64, 64, 7)
    assert inject_weight_prefetch(func).script() == func.script()


def _gemm(rows: int, cols: int, depth: int):
    """A GEMM reading its weights packed in 32-column panels, W[j // 32, k, j % 32] (te_passes/layout.py)."""
    a_t = te.placeholder((rows, depth), name="a")
    w_t = te.placeholder((cols // 32, depth, 32), name="w")
    k = te.reduce_axis((0, depth), name="k")
    c_t = te.compute((rows, cols), lambda i, j: te.sum(a_t[i, k] * w_t[j // 32, k, j % 32], axis=k), name="c")
    return te.create_prim_func([a_t, w_t, c_t])


@pytest.mark.parametrize("rows,depth,streamed", [(16, 256, True), (128, 256, True), (196, 512, True),
                                                  (512, 256, False)])
def test_gemms_of_few_rows_stream_their_panels(rows, depth, streamed):
    """Up to STREAM_GEMM_ROWS rows (BERT's 128, Swin-B's 196) each 1-2 MB panel set is streamed; more rows
    reuse it enough."""
    func = schedule_cpu(_gemm(rows, 1024, depth))
    assert ("T.prefetch" in func.script()) == streamed
    a, w = _rand(rows, depth), _rand(32, depth, 32)
    lib = tvm.compile(func, target=TARGET)
    out = tvm.runtime.tensor(np.full((rows, 1024), np.nan, np.float32))
    lib["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(w), out)
    np.testing.assert_allclose(out.numpy(), a @ w.transpose(1, 0, 2).reshape(depth, 1024), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("rows,streamed", [(128, True), (512, False)])
def test_a_default_stage_schedule_says_whether_it_streams(rows, streamed):
    """Tuning leaves a streamed default alone (tuning.py): the marks in its schedule say so."""
    sch = s_tir.Schedule(_gemm(rows, 1024, 256))
    schedule_blocks(sch, ["c"])
    assert streams_weights(sch.mod["main"]) == streamed
    assert not streams_weights(inject_weight_prefetch(sch.mod["main"]))  # compiled: the marks are consumed


def test_a_streamed_gemm_chunk_spans_the_panels_its_output_allows():
    """Streamed, a chunk keeps one piece of each panel in L2, so BERT's 3072-deep GEMM (a 384 KB panel, over
    the L2 chunk) takes 6 panels per chunk, not 1: 4 chunks of 128 x 192 outputs (96 KB), one per
    parallel iteration, each row tile's inputs serving 6 panels."""
    func = schedule_cpu(_gemm(128, 768, 3072))
    script = func.script()
    assert "T.prefetch" in script
    assert re.findall(r"in T\.parallel\((\d+)\)", script) == ["4"]
    a, w = _rand(128, 3072), _rand(24, 3072, 32)
    lib = tvm.compile(func, target=TARGET)
    out = tvm.runtime.tensor(np.full((128, 768), np.nan, np.float32))
    lib["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(w), out)
    np.testing.assert_allclose(out.numpy(), a @ w.transpose(1, 0, 2).reshape(3072, 768), rtol=1e-4, atol=1e-3)
