import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


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
