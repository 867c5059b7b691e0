"""run() on one model from many threads at once: every call gets its own workspace (workspace.py), so each
output is exactly what a call alone computes for its own inputs, and no later call overwrites an array a
caller holds."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import souffle_py
from models.registry import build_model
from souffle_py.errors import InputError

THREADS, CALLS, DISTINCT_INPUTS = 4, 150, 6


def _hammer(model, feeds_list, expected):
    """THREADS threads x CALLS calls on `model`, each on one of `feeds_list` (by a per-thread schedule);
    returns the wrong outputs found (outputs kept until every thread is done, then checked)."""
    results = [[] for _ in range(THREADS)]
    errors = []
    start = threading.Barrier(THREADS)

    def work(t):
        try:
            start.wait()
            for i in range(CALLS):
                k = (t * 7 + i * 5) % len(feeds_list)
                results[t].append((k, model.run(feeds_list[k])))
        except Exception as exc:  # noqa: BLE001  (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    wrong = 0
    for per_thread in results:
        assert len(per_thread) == CALLS
        for k, outputs in per_thread:
            wrong += sum(not np.array_equal(outputs[n], expected[k][n], equal_nan=True) for n in expected[k])
    return wrong


@pytest.fixture(scope="module")
def attention():
    model = souffle_py.optimize(build_model("bert", tiny=True), quiet=True)
    feeds_list = [model.random_feeds(seed=s) for s in range(DISTINCT_INPUTS)]
    return model, feeds_list


def test_threads_share_one_compiled_model(attention):
    model, feeds_list = attention
    expected = [model.run(f) for f in feeds_list]
    assert not any(np.array_equal(expected[0][n], expected[1][n]) for n in expected[0])  # inputs matter
    assert _hammer(model, feeds_list, expected) == 0
    assert model._pool.created >= 2  # calls overlapped, each in a workspace of its own


def test_threads_share_one_loaded_model(attention, tmp_path):
    model, feeds_list = attention
    model.export(tmp_path / "m.tar")
    loaded = souffle_py.load(tmp_path / "m.tar")
    expected = [model.run(f) for f in feeds_list]
    assert _hammer(loaded, feeds_list, expected) == 0


def test_a_recurrent_model_under_threads():
    """A recurrence reads its previous step in place in its workspace: concurrent calls must not mix."""
    model = souffle_py.optimize(build_model("lstm", tiny=True), quiet=True)
    feeds_list = [model.random_feeds(seed=s) for s in range(3)]
    expected = [model.run(f) for f in feeds_list]
    assert _hammer(model, feeds_list, expected) == 0


def test_returned_arrays_are_never_overwritten(attention):
    model, feeds_list = attention
    first = model.run(feeds_list[0])
    kept = {n: v.copy() for n, v in first.items()}
    for feeds in feeds_list[1:]:
        model.run(feeds)
    for name, value in first.items():
        np.testing.assert_array_equal(value, kept[name])


def test_outputs_written_into_the_callers_arrays(attention):
    model, feeds_list = attention
    expected = model.run(feeds_list[2])
    out = {n: np.full_like(v, np.nan) for n, v in expected.items()}
    result = model.run(feeds_list[2], out=out)
    for name in expected:
        assert result[name] is out[name]
        np.testing.assert_array_equal(out[name], expected[name])
    name = next(iter(expected))
    with pytest.raises(InputError, match="out names unknown output"):
        model.run(feeds_list[2], out={"nope": out[name]})
    with pytest.raises(InputError, match=f"out\\['{name}'\\] is"):
        model.run(feeds_list[2], out={name: np.zeros(3, np.float32)})


def test_feeds_in_any_layout_and_mapping(attention):
    """The fast path takes a dict of exact arrays; anything else that fits (a read-only mapping, a
    non-contiguous array) takes the checked path and gives the same result."""
    from types import MappingProxyType

    model, feeds_list = attention
    feeds = feeds_list[3]
    expected = model.run(feeds)
    name = next(n for n, v in feeds.items() if v.ndim >= 2)
    strided = {**feeds, name: np.asfortranarray(feeds[name])}
    assert not strided[name].flags.c_contiguous
    for variant in (MappingProxyType(feeds), strided):
        got = model.run(variant)
        for n in expected:
            np.testing.assert_array_equal(got[n], expected[n])
