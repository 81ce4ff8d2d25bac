import os
import random
import tempfile
import warnings
import zlib

import numpy as np
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


@pytest.fixture(autouse=True)
def _rngs_seeded_by_test_id(request):
    """Each test draws from torch's (CPU and CUDA), numpy's and Python's global generators seeded by its own id,
    so its inputs do not depend on which tests ran before it in the process: a failure reproduces when the test
    runs alone. (Two GPU tests failed now and then on unseeded draws: sixty-third and sixty-fourth sessions.)"""
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)  # (CUDA's generators too, lazily: no CUDA initialisation on a CPU machine)
    np.random.seed(seed)
    random.seed(seed)


@pytest.fixture(autouse=True)
def _planned_occupancy_holds(request):
    """A GPU test fails where a kernel it loads holds fewer CTAs per SM than its planner sized the grid for
    (OccupancyWarning raised as an error): the answers stay right, a second wave later, so an accuracy test alone
    would pass. Only on compute capability 9.0, the H100 / H200 whose shared memory the planners assume. (The GPU
    fuzz's verify draws at seeds 1448, 1461, 1594 and 1600 met such fp8 shapes and only warned, 111th session.)"""
    with warnings.catch_warnings():
        if HAS_GPU and "gpu" in request.keywords and torch.cuda.get_device_capability() == (9, 0):
            from attnforge import OccupancyWarning  # (here: attnforge loads after the env above is set)
            warnings.simplefilter("error", OccupancyWarning)
        yield


@pytest.fixture(autouse=True)
def _gpu_memory_log(request):
    """With ATTNFORGE_TEST_MEMLOG=<file>, a line per test: its id and the CUDA bytes torch holds after it (live and
    reserved), so a test that leaves tensors alive shows as a step (the memcheck process ran out of memory once);
    the cached blocks go back after each."""
    yield
    path = os.environ.get("ATTNFORGE_TEST_MEMLOG")
    if path and HAS_GPU and torch.cuda.is_initialized():
        from helpers import log_test_memory  # (here: attnforge loads after the env above is set)
        log_test_memory(path, request.node.nodeid)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (METHOD.md)."""
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))
