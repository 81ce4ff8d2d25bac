import os
import tempfile

import pytest
import torch

# One cache per test session (not the user's): builds are reused across tests, never stale.
_SESSION_CACHE = tempfile.mkdtemp(prefix="attnforge-test-cache-")
os.environ.setdefault("ATTNFORGE_CACHE_DIR", _SESSION_CACHE)
os.environ.setdefault("ATTNFORGE_CUDA_ARCH_LIST", "9.0a")

HAS_GPU = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="no CUDA GPU present")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (METHOD.md)."""
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))
