"""The compile cache (souffle_py/compile_cache.py): a second optimize() of the same model, options, target
and code loads the stored export; anything else that changes misses; least recently used entries go
first; two processes writing one entry at once leave one whole entry; a damaged entry is compiled again.
Weights are blobs stored once for every entry using them (weight_store.py): a missing or damaged blob is
compiled again too, and eviction removes the blobs no entry refers to."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest

import souffle_py
from models.registry import build_model
from models.dynamic import symbolic
from souffle_py import code_version, compile_cache, weight_store
from souffle_py.cli import main


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SOUFFLE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(compile_cache.SIZE_ENV, raising=False)
    monkeypatch.setenv(compile_cache.ENABLE_ENV, "1")
    return tmp_path / "cache" / "models"


@pytest.fixture(scope="module")
def mmoe_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "mmoe.onnx"
    onnx.save(build_model("mmoe", tiny=True), path)
    return path


def _no_compile(monkeypatch):
    """Make compiling fail: a hit must not compile."""
    import souffle_py.frontend

    def refuse(*args, **kwargs):
        raise AssertionError("compiled although the cache holds the model")

    monkeypatch.setattr(souffle_py.frontend, "lower", refuse)


def test_a_second_compile_loads_the_stored_model(cache, mmoe_path, monkeypatch):
    first = souffle_py.optimize(mmoe_path, quiet=True)
    assert not first.cached and len(list(cache.glob("*.tar"))) == 1
    feeds = first.random_feeds()
    expected = first.run(feeds)
    _no_compile(monkeypatch)
    second = souffle_py.optimize(mmoe_path, quiet=True)
    assert second.cached
    for name, value in second.run(feeds).items():
        np.testing.assert_array_equal(value, expected[name])
    assert second.describe() == first.describe()


def test_a_new_process_loads_it_too_without_importing_the_compiler(cache, mmoe_path):
    """The alias answers before TVM is imported: the process runs the model on tvm_ffi and the TVM runtime
    library alone (memory.py), and its outputs are the compiled model's."""
    first = souffle_py.optimize(mmoe_path, quiet=True)
    feeds = first.random_feeds()
    np.savez(cache.parent / "feeds.npz", **feeds)
    code = ("import sys, numpy as np, souffle_py; "
            f"m = souffle_py.optimize({str(mmoe_path)!r}, quiet=True); "
            f"feeds = dict(np.load({str(cache.parent / 'feeds.npz')!r})); out = m.run(feeds); "
            f"np.savez({str(cache.parent / 'out.npz')!r}, **out); "
            # the paths that copy inputs the slow way: benchmark, profile, a feed that is not exactly declared
            "m.benchmark(feeds, repeat=1, warmup=0); m.profile(feeds, repeat=1); "
            "m.run({k: np.asfortranarray(v) for k, v in feeds.items()}); "
            "print(m.cached, 'tvm' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "SOUFFLE_CACHE": str(cache.parent)})
    assert out.stdout.strip() == "True False False", out.stderr[-2000:]
    got = np.load(cache.parent / "out.npz")
    for name, value in first.run(feeds).items():
        np.testing.assert_array_equal(got[name], value)


def test_a_rewritten_model_file_misses(cache, tmp_path):
    """The model's digest is remembered with the file's stat: new bytes at the same path are a new model."""
    path = tmp_path / "m.onnx"
    onnx.save(build_model("mmoe", tiny=True), path)
    assert not souffle_py.optimize(path, quiet=True).cached
    assert souffle_py.optimize(path, quiet=True).cached
    onnx.save(build_model("mmoe", tiny=True, seed=1), path)
    assert not souffle_py.optimize(path, quiet=True).cached


@pytest.mark.parametrize("change", [dict(fast_math=False), dict(passes="none"), dict(merge=False),
                                    dict(cache_code=True), dict(model=True)])
def test_what_changes_the_compile_misses(cache, mmoe_path, monkeypatch, change):
    souffle_py.optimize(mmoe_path, quiet=True)
    if change.pop("cache_code", False):
        code_version.code_hash.cache_clear()
        monkeypatch.setattr(code_version, "code_hash", lambda: "another souffle-py")
        monkeypatch.setattr(compile_cache, "code_hash", lambda: "another souffle-py")
    model = mmoe_path
    if change.pop("model", False):
        model = build_model("mmoe", tiny=True, seed=1)
    again = souffle_py.optimize(model, quiet=True, **change)
    assert not again.cached
    assert len(list(cache.glob("*.tar"))) == 2


def test_cache_false_compiles_and_stores_nothing(cache, mmoe_path):
    assert not souffle_py.optimize(mmoe_path, quiet=True, cache=False).cached
    assert not cache.exists() or not list(cache.glob("*.tar"))


def test_least_recently_used_entries_are_evicted(cache, mmoe_path, monkeypatch):
    souffle_py.optimize(mmoe_path, quiet=True)
    souffle_py.optimize(mmoe_path, quiet=True, fast_math=False)  # second entry
    souffle_py.optimize(mmoe_path, quiet=True)                   # a hit: the first is now the most recent
    souffle_py.optimize(mmoe_path, quiet=True, passes="none")    # third entry (its own weights): one must go
    third, first, second = compile_cache.entries()
    sizes = compile_cache.blob_sizes()  # the size counts each blob once, however many entries use it
    room = third.bytes + first.bytes + sum(sizes[d] for d in third.weights | first.weights)
    monkeypatch.setenv(compile_cache.SIZE_ENV, str(room + second.bytes // 2))
    compile_cache.evict(compile_cache.size_limit())
    keys = [e.key for e in compile_cache.entries()]
    assert len(keys) == 2
    assert souffle_py.optimize(mmoe_path, quiet=True).cached            # kept: used last but one
    assert not souffle_py.optimize(mmoe_path, quiet=True, fast_math=False, cache=True).cached  # evicted


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_a_damaged_entry_is_compiled_again(cache, mmoe_path, caplog, damage):
    """An entry verified once is trusted while its file is unchanged; a file written since (a byte flipped
    in its weights keeps its size) is verified again, and fails."""
    souffle_py.optimize(mmoe_path, quiet=True)
    assert souffle_py.optimize(mmoe_path, quiet=True).cached
    entry = next(cache.glob("*.tar"))
    data = bytearray(entry.read_bytes())
    if damage == "flipped":
        import tarfile

        with tarfile.open(entry) as archive:
            member = archive.getmember("kernels.so")
        data[member.offset_data + member.size // 2] ^= 0x40
    entry.write_bytes(bytes(data) if damage == "flipped" else bytes(data[:5000]))
    again = souffle_py.optimize(mmoe_path, quiet=True)
    assert not again.cached and "compile cache: entry" in caplog.text
    assert souffle_py.optimize(mmoe_path, quiet=True).cached  # stored again, whole


def test_concurrent_writers_leave_one_whole_entry(cache, mmoe_path):
    code = f"import souffle_py; souffle_py.optimize({str(mmoe_path)!r}, quiet=True)"
    env = {**os.environ, "SOUFFLE_CACHE": str(cache.parent), compile_cache.ENABLE_ENV: "1", "TVM_NUM_THREADS": "1"}
    writers = [subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE) for _ in range(2)]
    for writer in writers:
        assert writer.wait(timeout=600) == 0, writer.stderr.read()[-2000:]
    assert len(list(cache.glob("*.tar"))) == 1 and not list(cache.glob(".*"))  # no temporary file left
    assert compile_cache.read_entry(next(cache.glob("*.tar")))  # checked against its SHA-256s, blobs included


def test_souffle_cache_ls_and_clear(cache, mmoe_path, capsys):
    souffle_py.optimize(mmoe_path, quiet=True)
    assert main(["cache", "ls"]) == 0
    listing = capsys.readouterr().out
    assert "1 compiled models in" in listing and "mmoe.onnx" in listing
    assert f"weights in {len(_blobs(cache))} blobs" in listing and len(_blobs(cache)) > 1
    assert main(["cache", "clear"]) == 0
    assert "removed 1 compiled models" in capsys.readouterr().out
    assert not compile_cache.entries() and not _blobs(cache) and not list((cache / "weights").iterdir())


def test_a_bad_size_limit_is_named(cache, monkeypatch):
    monkeypatch.setenv(compile_cache.SIZE_ENV, "lots")
    with pytest.raises(souffle_py.InputError, match="SOUFFLE_CACHE_SIZE"):
        compile_cache.size_limit()


def _blobs(cache) -> list:
    return sorted((cache / "weights").glob("*.npy"))


def test_weights_are_stored_once_for_every_entry_using_them(cache, mmoe_path):
    """Two entries with equal weights (fast_math changes the kernels, not the weights) share every blob."""
    first = souffle_py.optimize(mmoe_path, quiet=True)
    blobs = _blobs(cache)
    assert 1 < len(blobs) <= len(first.params)
    assert all(hashlib.sha256(p.read_bytes()).hexdigest() == p.stem for p in blobs)  # named by their bytes
    souffle_py.optimize(mmoe_path, quiet=True, fast_math=False)
    assert _blobs(cache) == blobs and len(list(cache.glob("*.tar"))) == 2
    # touched, not rewritten, and still known verified: the next load reads them without hashing
    assert all(p.with_suffix(".verified").read_text() == weight_store.stamp(p) for p in blobs)
    one, two = compile_cache.entries()
    assert one.weights == two.weights == {p.stem for p in blobs}
    import tarfile

    with tarfile.open(one.path) as archive:
        assert "params.npz" not in archive.getnames() and "weights.json" in archive.getnames()
    assert f"{len(blobs)} of them shared by several entries" in compile_cache.describe_entries()


def test_a_dynamic_model_stores_its_shapes_weights_once(cache):
    """The tiny BERT at two sequence lengths: the weights both shapes use are one blob each."""
    bert = symbolic("bert", tiny=True)
    shapes = [{"batch": 1, "sequence": 5}, {"batch": 1, "sequence": 9}]
    model = souffle_py.optimize(bert, dynamic={"batch": (1, 2), "sequence": (1, 16)}, precompile=shapes,
                                quiet=True)
    one, two = (model.specialise(shape) for shape in shapes)
    blobs = {p.stem for p in _blobs(cache)}
    first, second = compile_cache.entries()
    assert first.weights | second.weights == blobs
    assert len(blobs) < len(one.params) + len(two.params) and len(first.weights & second.weights) > 1


def test_hits_read_the_blobs_once_per_process(cache, mmoe_path, monkeypatch):
    """A hit's weights are the blobs' read-only arrays, the same objects while a model holding them lives;
    after the in-process memo is dropped (as in a new process), read again: the outputs are the compile's."""
    first = souffle_py.optimize(mmoe_path, quiet=True)
    feeds = first.random_feeds()
    expected = first.run(feeds)
    _no_compile(monkeypatch)
    second = souffle_py.optimize(mmoe_path, quiet=True)
    third = souffle_py.optimize(mmoe_path, quiet=True)
    assert second.cached and third.cached
    assert all(third.params[name] is values for name, values in second.params.items())
    assert not any(values.flags.writeable for values in second.params.values())
    weight_store.forget()
    fourth = souffle_py.optimize(mmoe_path, quiet=True)
    assert fourth.cached and all(fourth.params[name] is not values for name, values in second.params.items())
    for model in (second, fourth):
        for name, value in model.run(feeds).items():
            np.testing.assert_array_equal(value, expected[name])


@pytest.mark.parametrize("damage", ["overwritten", "missing"])
def test_a_damaged_or_missing_blob_is_compiled_again(cache, mmoe_path, caplog, monkeypatch, damage):
    """A blob rewritten since it was verified (its stat differs) is hashed again and fails; a missing one
    fails too: the entry is discarded with a warning, the damaged blob removed, and the model compiled."""
    first = souffle_py.optimize(mmoe_path, quiet=True)
    feeds = first.random_feeds()
    expected = first.run(feeds)
    assert souffle_py.optimize(mmoe_path, quiet=True).cached
    blob = max(_blobs(cache), key=lambda p: p.stat().st_size)
    if damage == "missing":
        blob.unlink()
    else:
        data = bytearray(blob.read_bytes())
        data[-8:] = bytes(b ^ 0x5A for b in data[-8:])
        blob.write_bytes(bytes(data))
        stat = blob.stat()
        os.utime(blob, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    removed, remove = [], weight_store._remove
    monkeypatch.setattr(weight_store, "_remove", lambda path: removed.append(path.name) or remove(path))
    again = souffle_py.optimize(mmoe_path, quiet=True)
    assert not again.cached and "compile cache: entry" in caplog.text and "is unusable" in caplog.text
    assert removed == ([blob.name] if damage == "overwritten" else [])
    assert hashlib.sha256(blob.read_bytes()).hexdigest() == blob.stem  # stored again by the new compile
    for name, value in again.run(feeds).items():
        np.testing.assert_array_equal(value, expected[name])
    weight_store.forget()
    hit = souffle_py.optimize(mmoe_path, quiet=True)
    assert hit.cached
    for name, value in hit.run(feeds).items():
        np.testing.assert_array_equal(value, expected[name])


def test_eviction_removes_the_blobs_no_entry_refers_to(cache, mmoe_path, monkeypatch):
    """Evicting an entry leaves its blobs until they are older than the grace period (a concurrent writer
    may be about to refer to them); then those no entry refers to go, and the kept entry's stay."""
    souffle_py.optimize(mmoe_path, quiet=True)
    souffle_py.optimize(build_model("mmoe", tiny=True, seed=1), quiet=True)  # other weights, used last
    newest, oldest = compile_cache.entries()
    only_oldest = oldest.weights - newest.weights
    assert only_oldest
    sizes = compile_cache.blob_sizes()
    limit = newest.bytes + sum(sizes[d] for d in newest.weights)  # room for the newest entry alone
    assert compile_cache.evict(limit) == [oldest.key]
    assert {p.stem for p in _blobs(cache)} == newest.weights | oldest.weights  # young: kept
    monkeypatch.setattr(compile_cache, "GRACE_SECONDS", 0)
    assert compile_cache.evict(limit) == []
    assert {p.stem for p in _blobs(cache)} == newest.weights
    assert not [p for p in (cache / "weights").glob("*.verified") if p.stem not in newest.weights]
    assert souffle_py.optimize(build_model("mmoe", tiny=True, seed=1), quiet=True).cached
