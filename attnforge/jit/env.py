"""Every environment knob attnforge reads, typed and documented in one place.

Values are read at access time, so tests and users can change os.environ at run time.
docs/architecture.md carries the same table (a test checks they agree).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


def _bool(s: str) -> bool:
    return s.strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Knob(Generic[T]):
    name: str
    parse: Callable[[str], T]
    default: Callable[[], T]
    doc: str

    @property
    def value(self) -> T:
        raw = os.environ.get(self.name)
        if raw is None or raw == "":
            return self.default()
        try:
            return self.parse(raw)
        except ValueError as e:
            raise ValueError(f"environment variable {self.name}={raw!r} is invalid: {e}") from None


CACHE_DIR = Knob("ATTNFORGE_CACHE_DIR", lambda s: Path(s).expanduser(),
                 lambda: Path("~/.cache/attnforge").expanduser(),
                 "Root of the compiled-kernel cache (default ~/.cache/attnforge).")
CUDA_ARCH_LIST = Knob("ATTNFORGE_CUDA_ARCH_LIST", str,
                      lambda: os.environ.get("TORCH_CUDA_ARCH_LIST", ""),
                      "Archs to build, e.g. '9.0a' or '8.0 9.0a+PTX'; else TORCH_CUDA_ARCH_LIST, "
                      "else the visible GPU, else 9.0a.")
JIT_VERBOSE = Knob("ATTNFORGE_JIT_VERBOSE", _bool, lambda: False,
                   "1: stream ninja/nvcc output while building.")
DISABLE_JIT = Knob("ATTNFORGE_DISABLE_JIT", _bool, lambda: False,
                   "1: never compile; a missing module is an error that says how to prebuild it.")
LOG_LEVEL = Knob("ATTNFORGE_LOG_LEVEL", str.upper, lambda: "INFO",
                 "Level of the 'attnforge' logger (DEBUG, INFO, WARNING).")
EXTRA_NVCC_FLAGS = Knob("ATTNFORGE_NVCC_FLAGS", str.split, lambda: [],
                        "Extra nvcc flags appended to every build (part of the cache key).")
LOCK_TIMEOUT_S = Knob("ATTNFORGE_LOCK_TIMEOUT", float, lambda: 1800.0,
                      "Seconds to wait for another process's build of the same module.")
MAX_JOBS = Knob("MAX_JOBS", int, lambda: max(1, (os.cpu_count() or 2)),
                "Parallel compile jobs (ninja -j).")
CUDA_HOME = Knob("CUDA_HOME", str, lambda: os.environ.get("CUDA_PATH", ""),
                 "CUDA toolkit root; nvcc is looked up there first, then on PATH.")


def _prefill_backend(s: str) -> str:
    s = s.strip().lower()
    if s not in ("auto", "wgmma", "mma"):
        raise ValueError("expected auto, wgmma or mma")
    return s


PREFILL_BACKEND = Knob("ATTNFORGE_PREFILL_BACKEND", _prefill_backend, lambda: "auto",
                       "Prefill kernel: auto (wgmma on sm_90a where it applies, else mma), wgmma or mma.")

ATTENTION_DECODE = Knob("ATTNFORGE_ATTENTION_DECODE", _bool, lambda: False,
                        "1: attention() calls of one query a request (or up to 8 causal ones) run on the decode "
                        "kernels, K/V read in place (attnforge/dense_decode.py); 0 (default until timed on a GPU): on "
                        "the prefill kernels.")

ALL_KNOBS = (CACHE_DIR, CUDA_ARCH_LIST, JIT_VERBOSE, DISABLE_JIT, LOG_LEVEL, EXTRA_NVCC_FLAGS,
             LOCK_TIMEOUT_S, MAX_JOBS, CUDA_HOME, PREFILL_BACKEND, ATTENTION_DECODE)


def markdown_table() -> str:
    rows = ["| variable | meaning |", "|---|---|"]
    rows += [f"| `{k.name}` | {k.doc} |" for k in ALL_KNOBS]
    return "\n".join(rows)
