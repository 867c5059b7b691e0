import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# strict mode (souffle_py/failures.py): a schedule rule or TE pass that fails raises instead of warning, so
# no failure hides in the tests as a slower kernel
os.environ.setdefault("SOUFFLE_STRICT", "1")
# every test compiles what it asks for (a test that patches a rule must not get an earlier test's model from
# the compile cache); the cache's own tests turn it on
os.environ["SOUFFLE_COMPILE_CACHE"] = "0"

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two workers on two cores: each keeps its own tuning database (two processes
    # appending to one would race) and runs TVM's kernels on one thread (two spinning thread pools on
    # two cores starve each other).
    # The database is removed when the worker exits: each run left two directories in the temporary folder.
    import atexit
    import shutil
    import tempfile

    if "SOUFFLE_CACHE" not in os.environ:
        os.environ["SOUFFLE_CACHE"] = tempfile.mkdtemp(prefix=f"souffle-test-{os.environ['PYTEST_XDIST_WORKER']}-")
        atexit.register(shutil.rmtree, os.environ["SOUFFLE_CACHE"], ignore_errors=True)
    os.environ.setdefault("TVM_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need an NVIDIA GPU: skipped, never failing, on machines without one."""
    gpu_tests = [item for item in items if "gpu" in item.keywords]
    if not gpu_tests:
        return
    from souffle_py.backends.cuda.specs import gpu_present

    if not gpu_present():
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU (TVM's CUDA runtime sees none)")
        for item in gpu_tests:
            item.add_marker(skip)
