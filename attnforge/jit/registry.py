"""In-process registry: the second request for a module costs one dictionary look-up."""
from __future__ import annotations

import threading
import warnings
from typing import Callable, Hashable

import torch

from . import builder as _build
from .loader import LoadedLibrary

_libraries: dict[tuple, LoadedLibrary] = {}
_lock = threading.Lock()


def get_library(key: Hashable, make_module: Callable[[], "_build.JitModule"],
                device: torch.device) -> LoadedLibrary:
    """`key` is any hashable spec; `make_module` is only called on a miss."""
    full_key = (key, device.index if device.index is not None else torch.cuda.current_device())
    lib = _libraries.get(full_key)
    if lib is not None:
        return lib
    with _lock:
        lib = _libraries.get(full_key)
        if lib is None:
            module = make_module()
            path = _build.build(module)
            lib = LoadedLibrary(path, module.kernel_names, device)
            check_occupancy(key, module.name, lib[module.kernel_names[0]])
            _libraries[full_key] = lib
    return lib


def load_all(kernels, device: torch.device) -> tuple[str, ...]:
    """get_library for each kernel spec (anything with a `module()` method, the registry's key) on `device`:
    a wrapper's load_kernels(). Returns the module names, in order, without repeats."""
    if device.type != "cuda":  # (a host-only wrapper: its plans run without a GPU, nothing loads there)
        raise ValueError(f"load_kernels: expected a wrapper on a CUDA device, got one on {device}. Construct it with "
                         f"device='cuda' (or 'cuda:N') on a machine with a GPU.")
    names = []
    for kernel in kernels:
        module = kernel.module()  # (its name; get_library builds from it on a miss)
        get_library(kernel, lambda m=module: m, device)
        if module.name not in names:
            names.append(module.name)
    return tuple(names)


class OccupancyWarning(UserWarning):
    """A kernel holds fewer CTAs per SM on this GPU than its planner sizes the persistent grid for."""


def check_occupancy(kernel, module_name: str, loaded) -> None:
    """Decode, MLA and prefill plan their persistent grids (and split KV) for kernel.ctas_per_sm CTAs an SM,
    which the kernel classes derive from rules (registers, shared memory) that CI checks on the variant matrix
    only. Once a cubin is loaded the driver knows: where it holds fewer, the grid's extra CTAs would run as a
    second wave (up to twice the time, with no error), so say so. Other modules (no ctas_per_sm) pass."""
    assumed = getattr(kernel, "ctas_per_sm", None)
    if not isinstance(assumed, int) or not hasattr(kernel, "threads") or not hasattr(kernel, "smem_bytes"):
        return
    held = loaded.max_active_ctas(kernel.threads, kernel.smem_bytes)
    if held == 0:
        warnings.warn(f"{module_name}: this GPU cannot hold one of its CTAs ({kernel.threads} threads, "
                      f"{kernel.smem_bytes} B of shared memory): its launches will fail. Use fewer stages or a "
                      f"smaller tile (the kernel class's options), or report the shape", OccupancyWarning,
                      stacklevel=3)
    elif held < assumed:
        warnings.warn(f"{module_name}: its planner sizes grids for {assumed} CTAs per SM, but this GPU holds "
                      f"{held} at once ({kernel.threads} threads, {kernel.smem_bytes} B of shared memory a CTA): "
                      f"the grid's extra CTAs run as a second wave, up to twice as slow. Pass ctas_per_sm={held} "
                      f"to the wrapper where it takes one (BatchDecode, BatchMLADecode), and report the shape",
                      OccupancyWarning, stacklevel=3)


def clear() -> None:
    with _lock:
        _libraries.clear()
