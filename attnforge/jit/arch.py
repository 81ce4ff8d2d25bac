"""Target architecture list and the nvcc toolchain it is built with."""
from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path
from typing import Optional

from . import env

_ARCH_RE = re.compile(r"^(\d+)\.(\d+)(a|f)?(\+PTX)?$")


def _match_arch(text: str) -> re.Match:
    m = _ARCH_RE.match(text) if isinstance(text, str) else None
    if m is None:
        raise ValueError(f"arch {text!r} in the arch list: expected forms like '9.0a', '8.0' or "
                         "'9.0a+PTX' (not 'sm_90a' or '90a'). Fix ATTNFORGE_CUDA_ARCH_LIST "
                         "(or TORCH_CUDA_ARCH_LIST), or the archs passed to the build.")
    return m


def parse_arch_list(text: str) -> tuple[str, ...]:
    """'9.0a 8.0+PTX' or '9.0a;8.0' -> sorted, de-duplicated normalised entries."""
    items = [t for t in re.split(r"[\s;,]+", text.strip()) if t]
    for t in items:
        _match_arch(t)
    return tuple(sorted(set(items)))


def _visible_gpu_arch() -> str | None:
    try:
        import torch
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return f"{major}.{minor}" + ("a" if major >= 9 else "")
    except Exception:  # torch without CUDA, or a broken driver: fall through to the default
        return None
    return None


def arch_list() -> tuple[str, ...]:
    text = env.CUDA_ARCH_LIST.value
    if text.strip():
        return parse_arch_list(text)
    return (_visible_gpu_arch() or "9.0a",)


def gencode_flags(archs: tuple[str, ...]) -> list[str]:
    flags = []
    for a in archs:
        major, minor, suffix, ptx = _match_arch(a).groups()
        sm = f"{major}{minor}{suffix or ''}"
        flags.append(f"-gencode=arch=compute_{sm},code=sm_{sm}")
        if ptx:
            flags.append(f"-gencode=arch=compute_{sm},code=compute_{sm}")
    return flags


def arch_tag(archs: tuple[str, ...]) -> str:
    return "_".join(a.replace(".", "").replace("+PTX", "ptx") for a in archs)


def artifact_suffix(archs: tuple[str, ...]) -> str:
    """One real arch and no PTX: a cubin; anything more: a fatbin."""
    return "cubin" if len(archs) == 1 and "+PTX" not in archs[0] else "fatbin"


def nvcc_path() -> Path:
    home = env.CUDA_HOME.value
    if home and (Path(home) / "bin" / "nvcc").exists():
        return Path(home) / "bin" / "nvcc"
    found = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists()
                                     else None)
    if not found:
        raise RuntimeError("nvcc not found: install the CUDA toolkit (12.4+) and put nvcc on PATH, "
                           "or set CUDA_HOME.")
    return Path(found)


def nvdisasm_path() -> Optional[Path]:
    """nvdisasm on PATH, beside nvcc, or from the nvidia-cuda-nvdisasm wheel (the test extra: CI's toolkit
    has nvcc alone); None where there is none. Tests and tools read SASS with it; builds never need it."""
    found = shutil.which("nvdisasm")
    if found:
        return Path(found)
    try:
        beside = nvcc_path().parent / "nvdisasm"
        if beside.exists():
            return beside
    except RuntimeError:
        pass
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for tool in sorted(Path(root).glob("*/bin/nvdisasm")):
            return tool
    return None


@lru_cache(maxsize=4)
def _nvcc_version_text(path: str) -> str:
    return subprocess.run([path, "--version"], capture_output=True, text=True, check=True).stdout


def nvcc_version() -> str:
    """'13.0' style release, parsed from `nvcc --version`."""
    text = _nvcc_version_text(str(nvcc_path()))
    m = re.search(r"release (\d+\.\d+)", text)
    return m.group(1) if m else "unknown"


def nvcc_version_full() -> str:
    return _nvcc_version_text(str(nvcc_path())).strip().splitlines()[-1]
