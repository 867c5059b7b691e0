"""scripts/bench.py end to end on the tiny BERT: the table it prints is the one it appends to --output."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "bench.py")


def test_the_tiny_table_is_appended_to_the_output_file(tmp_path):
    out = tmp_path / "bench.md"
    out.write_text("# earlier\n")
    env = {**os.environ, "SOUFFLE_CACHE": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, SCRIPT, "--tiny", "--models", "bert", "--no-relax", "--repeat", "2",
                           "--output", str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    text = out.read_text()
    assert text.startswith("# earlier\n")  # appended, not overwritten
    assert "scripts/bench.py --tiny --models bert" in text and "TVM_NUM_THREADS=" in text
    assert "| souffle-py |" in text and "| ONNX Runtime |" in text
