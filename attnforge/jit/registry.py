"""In-process registry: the second request for a module costs one dictionary look-up."""
from __future__ import annotations

import threading
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
            _libraries[full_key] = lib
    return lib


def clear() -> None:
    with _lock:
        _libraries.clear()
