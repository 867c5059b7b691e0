"""A layout copy computed in its writer's tile (schedule/rules/layout_copy.py `in_writer_tile`): the copy of
an NHWC map that a parallel tiled nest writes moves into that nest's parallel loop, iterating over the
map's tile; a copy whose writer is one plain parallel block stays a pass of its own. Values checked by
running both schedules."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import s_tir, te, tirx

from souffle_py.cpu_target import using
from souffle_py.ir.marks import LAYOUT_COPY
from souffle_py.schedule.rules.dispatch import apply_rules
from souffle_py.schedule.rules.layout_copy import IN_WRITER_TILE


@pytest.fixture
def avx512():
    with using("sapphirerapids") as target:
        yield target


def _map_and_copy(size=8, channels=64):
    """x (int32, NHWC) -> m = int8(x >> 2) (NHWC) -> q: m's channel quads per flat pixel, + 128."""
    x = te.placeholder((1, size, size, channels), "int32", name="x")
    m = te.compute((1, size, size, channels), lambda n, h, w, c: (x[n, h, w, c] >> 2).astype("int8"), name="m")
    q = te.compute((1, channels // 4, size * size, 4), lambda b, cq, p, j: (
        m[b, p // size, p % size, cq * 4 + j].astype("int32") + 128).astype("uint8"), name="q", attrs={LAYOUT_COPY: 1})
    return [x, q]


def _tiled_writer(sch, tile_pixels=4):
    """m in tiles of one row x `tile_pixels` pixels x all channels, rows x tiles parallel, each tile computed
    into a local buffer and written back (two blocks under the parallel loop, as a conv's tiles are)."""
    block = sch.get_sblock("m")
    n, h, w, c = sch.get_loops(block)
    wo, wi = sch.split(w, [None, tile_pixels])
    tile = sch.fuse(n, h, wo)
    sch.parallel(tile)
    cached = sch.cache_write(block, 0, "local")
    sch.reverse_compute_at(cached, tile)


def _nests(sch) -> list[str]:
    """'loop kind: blocks under it' for each loop at the root."""
    root = sch.mod["main"].body.block.body
    nests = list(root) if isinstance(root, tirx.SeqStmt) else [root]
    out = []
    for nest in nests:
        names = []
        tvm_ffi.structural_walk(nest, [(s_tir.stmt.SBlock, lambda b: names.append(b.name_hint))])
        out.append(f"{int(nest.kind)}: {' '.join(sorted(names))}")
    return out


def _run(mod, size=8, channels=64) -> np.ndarray:
    lib = tvm.compile(mod, target="llvm")  # the host: scheduled for an AVX-512 CPU, the TIR runs anywhere
    x = np.random.default_rng(0).integers(-512, 512, (1, size, size, channels)).astype(np.int32)
    out = tvm.runtime.tensor(np.zeros((1, channels // 4, size * size, 4), np.uint8))
    lib["main"](tvm.runtime.tensor(x), out)
    return out.numpy()


def _expected(size=8, channels=64) -> np.ndarray:
    x = np.random.default_rng(0).integers(-512, 512, (1, size, size, channels)).astype(np.int32)
    m = (x >> 2).astype(np.int8).reshape(size * size, channels // 4, 4)
    return (m.astype(np.int32) + 128).astype(np.uint8).transpose(1, 0, 2)[None]


def test_a_copy_of_a_tiled_map_is_computed_in_the_writers_tile(avx512):
    sch = s_tir.Schedule(te.create_prim_func(_map_and_copy()))
    _tiled_writer(sch)
    apply_rules(sch, ["q"], lambda name: False)
    assert _nests(sch) == ["1: m m_local q"]  # one parallel nest: the copy in the writer's tile
    assert IN_WRITER_TILE in sch.get(sch.get_sblock("q")).annotations
    loops = [sch.get(loop) for loop in sch.get_loops(sch.get_sblock("q"))]
    # the tile's 4 pixels x 64 channels (the map's iteration), unrolled for LLVM's SLP vectorizer
    assert [(int(loop.extent), int(loop.kind)) for loop in loops] == [(16, 1), (4, 3), (64, 3)]
    np.testing.assert_array_equal(_run(sch.mod), _expected())


def test_a_copy_of_a_map_written_by_one_plain_parallel_block_stays_a_pass_of_its_own(avx512):
    sch = s_tir.Schedule(te.create_prim_func(_map_and_copy()))
    n, h, w, c = sch.get_loops(sch.get_sblock("m"))
    sch.parallel(sch.fuse(n, h))
    apply_rules(sch, ["q"], lambda name: False)
    assert [nest.split(":")[1].strip() for nest in _nests(sch)] == ["m", "q"]
    assert IN_WRITER_TILE not in sch.get(sch.get_sblock("q")).annotations
    np.testing.assert_array_equal(_run(sch.mod), _expected())


def test_a_copy_over_padded_pixels_stays_a_pass_of_its_own(avx512):
    """Pixels padded up to whole vectors (80 for 64, the map read at min(p, 63)): no bijective index to
    iterate over the map by, so the copy keeps its own nest."""
    x = te.placeholder((1, 8, 8, 64), "int32", name="x")
    m = te.compute((1, 8, 8, 64), lambda n, h, w, c: (x[n, h, w, c] >> 2).astype("int8"), name="m")
    q = te.compute((1, 16, 80, 4), lambda b, cq, p, j: (m[b, tirx.min(p, 63) // 8, tirx.min(p, 63) % 8, cq * 4 + j]
                                                          .astype("int32") + 128).astype("uint8"),
                   name="q", attrs={LAYOUT_COPY: 1})
    sch = s_tir.Schedule(te.create_prim_func([x, q]))
    _tiled_writer(sch)
    apply_rules(sch, ["q"], lambda name: False)
    assert [nest.split(":")[1].strip() for nest in _nests(sch)] == ["m m_local", "q"]


def test_a_copy_of_a_map_in_ragged_tiles_stays_a_pass_of_its_own(avx512):
    """Tiles of 3 pixels over rows of 8: the last tile of a row is cut short, so the copy moved into the tile
    would have a loop of varying extent; it keeps its own nest (the rule failed on such a map with a
    TypeError: MobileNetV3-small int8 with its quantized maps as graph outputs, under SOUFFLE_STRICT)."""
    sch = s_tir.Schedule(te.create_prim_func(_map_and_copy()))
    _tiled_writer(sch, tile_pixels=3)
    apply_rules(sch, ["q"], lambda name: False)
    assert [nest.split(":")[1].strip() for nest in _nests(sch)] == ["m m_local", "q"]
    assert IN_WRITER_TILE not in sch.get(sch.get_sblock("q")).annotations
    np.testing.assert_array_equal(_run(sch.mod), _expected())
