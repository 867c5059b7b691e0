"""scripts/bench_corpus.py's check, table and comparison (no corpus or torch needed)."""

from __future__ import annotations

import json
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))
import bench_corpus as bc  # noqa: E402


def test_the_error_is_relative_to_the_outputs_scale():
    reference = {"y": np.array([1e12, -3e11, 5.0], np.float32)}
    rounding = {"y": reference["y"] + np.float32(1e6)}  # float32 rounding at 1e12
    assert bc.scaled_error(rounding, reference) < 1e-5
    wrong = {"y": reference["y"] * np.float32(1.01)}
    assert bc.scaled_error(wrong, reference) > bc.SCALE_TOLERANCE
    assert bc.scaled_error({"y": np.array([np.nan, 0, 0], np.float32)}, reference) == math.inf
    assert bc.scaled_error({}, reference) == math.inf


def _row(name, souffle, ort, openvino=None, matches=True):
    ms = {bc.SOUFFLE: souffle, bc.ORT: ort, **({bc.OPENVINO: openvino} if openvino else {})}
    return {"name": name, "library": "x", "exporter": "dynamo", "compile_s": 2.0, "median_ms": ms,
            "error_vs_scale": {bc.SOUFFLE: 1e-7}, "matches": matches, "kernels": 3,
            "cuda": _cuda()}


def _cuda(fallbacks=()):
    return {"kernels": 4, "launches": 4, "grid_kernels": 3, "cooperative": 2, "grid_syncs": 5, "tes": 40,
            "grid_tes": 36, "share": 0.9, "fallbacks": [list(f) for f in fallbacks], "softmax": 2,
            "compile_s": 6.0}


def test_the_table_ends_with_geomeans_worst_cases_and_failures(tmp_path):
    report = {"date": "d", "commit": "c", "host": "h", "threads": 2, "repeat": 10, "wall_s": 60.0,
              "results": [_row("a", 2.0, 1.0, 4.0), _row("b", 1.0, 2.0, 1.0),
                          {"name": "c", "library": "x", "exporter": "classic", "error": "boom"}]}
    text = bc.format_report(report, 1.2)
    assert "geomean 1.00x, worst 2.00x (a, dynamo)" in text  # sqrt(2 * 0.5)
    assert "souffle-py / OpenVINO f32: geomean 0.71x, worst 1.00x" in text
    assert "- c (classic): boom" in text and "| 4 | 3 | 5 | 90% | 2.00 | 0 | 6.0 |" in text
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    old.write_text(json.dumps(report))
    report["results"][0] = _row("a", 1.0, 1.0)
    new.write_text(json.dumps(report))
    assert "over 2 exports in both: 1.00x -> 0.71x" in bc.compare(str(old), str(new))  # sqrt(2*.5) -> sqrt(.5)
    assert "| a | dynamo | 2.00x | 1.00x | 0.50 |" in bc.compare(str(old), str(new))


def test_the_cuda_column_alone_names_every_fallback():
    failed = {"name": "d", "library": "x", "exporter": "classic", "cuda": {"error": "TargetError: no"}}
    report = {"date": "d", "commit": "c", "host": "h", "wall_s": 60.0,
              "results": [{"name": "a", "library": "x", "exporter": "dynamo", "cuda": _cuda()},
                          {"name": "b", "library": "x", "exporter": "dynamo",
                           "cuda": _cuda([("s3", "grid schedule failed: ValueError: boom")])}, failed]}
    text = bc.format_cuda_report(report)
    assert "| a | dynamo | 4 | 3 | 5 | 90% | 2.00 | 0 | 6.0 |" in text and "| d | classic | failed |" in text
    assert "2 of 3 compiled; 1 with a fallback; 2 with at least 90% of their TEs in grid kernels" in text
    assert "- b (dynamo), s3: grid schedule failed: ValueError: boom" in text and "- d (classic): TargetError: no" in text
