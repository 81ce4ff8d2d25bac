"""Content-addressed, lock-protected JIT builds: rendered source -> ninja -> nvcc -> cubin.

Lifecycle of one module: look up the manifest -> take the module's file lock -> look
again (another process may just have built it) -> render, write build.ninja, run ninja ->
check the artifact and write the manifest atomically. Nothing trusts mtimes.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Iterable, Sequence

from filelock import FileLock, Timeout

from .. import __version__, codegen
from . import arch, env

log = logging.getLogger("attnforge.jit")

BASE_FLAGS = ("-O3", "-std=c++20", "--expt-relaxed-constexpr", "-Xptxas=--warn-on-spills",
              "-lineinfo", "-DNDEBUG")
_INCLUDE_RE = re.compile(r'^\s*#\s*include\s*[<"](attnforge/[^">]+)[">]', re.M)


class JitBuildError(RuntimeError):
    """nvcc/ninja failed; the message carries the compiler output and the source path."""


class MissingModuleError(RuntimeError):
    """ATTNFORGE_DISABLE_JIT=1 and the module is not in the cache."""


def header_closure(source: str, include_root: Path | None = None) -> list[Path]:
    """Every attnforge header the source includes, directly or through other headers."""
    root = include_root or codegen.include_dir()
    seen: dict[str, Path] = {}
    todo = _INCLUDE_RE.findall(source)
    while todo:
        rel = todo.pop()
        if rel in seen:
            continue
        path = root / rel
        if not path.is_file():
            raise JitBuildError(f"header {rel!r} included by generated source is missing under {root}")
        seen[rel] = path
        todo.extend(_INCLUDE_RE.findall(path.read_text()))
    return [seen[k] for k in sorted(seen)]


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class JitModule:
    """One compilation unit: a template, its variables, and the kernels it must export."""

    name: str
    template: str
    context: dict = field(hash=False, compare=False)
    kernel_names: tuple[str, ...] = ()
    archs: tuple[str, ...] = ()  # non-empty: build for exactly these (an sm_90a-only kernel), not the arch list

    @cached_property
    def source(self) -> str:
        return codegen.render(self.template, self.context)

    def flags(self, archs: tuple[str, ...]) -> list[str]:
        # Path-independent on purpose: the -I path is added at build time and never hashed.
        return [*BASE_FLAGS, *arch.gencode_flags(archs), *env.EXTRA_NVCC_FLAGS.value]

    def content_hash(self, archs: tuple[str, ...]) -> str:
        h = hashlib.sha256()
        h.update(self.source.encode())
        for path in header_closure(self.source):
            rel = path.relative_to(codegen.include_dir()).as_posix()
            h.update(f"\0{rel}\0".encode() + _sha256(path.read_bytes()).encode())
        h.update("\0".join(self.flags(archs)).encode())
        h.update(arch.nvcc_version_full().encode())
        return h.hexdigest()

    def build_dir(self, archs: tuple[str, ...]) -> Path:
        root = env.CACHE_DIR.value / __version__ / f"cu{arch.nvcc_version()}" / arch.arch_tag(archs)
        return root / f"{self.name}-{self.content_hash(archs)[:16]}"


@dataclass
class _Job:
    module: JitModule
    archs: tuple[str, ...]

    @cached_property
    def dir(self) -> Path:
        return self.module.build_dir(self.archs)

    @property
    def artifact(self) -> Path:
        return self.dir / f"kernel.{arch.artifact_suffix(self.archs)}"

    @property
    def manifest(self) -> Path:
        return self.dir / "manifest.json"

    def is_valid(self) -> bool:
        """A killed build or a truncated artifact fails one of these checks and is rebuilt."""
        try:
            m = json.loads(self.manifest.read_text())
            return (m["hash"] == self.module.content_hash(self.archs)
                    and _sha256(self.artifact.read_bytes()) == m["sha256"])
        except (OSError, ValueError, KeyError):
            return False

    def write_sources(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        _atomic_write(self.dir / "kernel.cu", self.module.source.encode())
        flags = " ".join([*self.module.flags(self.archs), f"-I{codegen.include_dir()}"])
        kind = arch.artifact_suffix(self.archs)
        ninja = (f"ninja_required_version = 1.3\n"
                 f"rule nvcc\n"
                 f"  command = {arch.nvcc_path()} {flags} --{kind} -o $out.tmp $in && mv -f $out.tmp $out\n"
                 f"  description = nvcc {self.module.name} ({' '.join(self.archs)})\n"
                 f"build {self.artifact}: nvcc {self.dir / 'kernel.cu'}\n")
        _atomic_write(self.dir / "build.ninja", ninja.encode())
        self.manifest.unlink(missing_ok=True)

    def write_manifest(self, seconds: float) -> None:
        data = self.artifact.read_bytes()
        manifest = {"name": self.module.name, "hash": self.module.content_hash(self.archs),
                    "artifact": self.artifact.name, "sha256": _sha256(data), "bytes": len(data),
                    "archs": list(self.archs), "nvcc": arch.nvcc_version_full(),
                    "flags": self.module.flags(self.archs), "build_seconds": round(seconds, 3),
                    "kernels": list(self.module.kernel_names)}
        _atomic_write(self.manifest, json.dumps(manifest, indent=1).encode())


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _ninja_binary() -> str:
    found = shutil.which("ninja")
    if found:
        return found
    try:
        import ninja  # the PyPI package ships the binary
        return str(Path(ninja.BIN_DIR) / "ninja")
    except ImportError:
        raise JitBuildError("ninja not found: pip install ninja") from None


def _run_ninja(build_file: Path, what: str, sources: Iterable[Path]) -> None:
    cmd = [_ninja_binary(), "-f", str(build_file), "-j", str(env.MAX_JOBS.value)]
    if env.JIT_VERBOSE.value:
        cmd.append("-v")
        proc = subprocess.run(cmd, cwd=build_file.parent, stdout=sys.stderr, stderr=sys.stderr)
        output = "(streamed above: ATTNFORGE_JIT_VERBOSE=1)"
    else:
        proc = subprocess.run(cmd, cwd=build_file.parent, capture_output=True, text=True)
        output = (proc.stdout + proc.stderr).strip()
    if proc.returncode != 0:
        srcs = "\n  ".join(str(s) for s in sources)
        raise JitBuildError(f"building {what} failed (ninja exit {proc.returncode}).\n"
                            f"Generated source:\n  {srcs}\nCompiler output:\n{output}")


def _lock(job: _Job) -> FileLock:
    job.dir.mkdir(parents=True, exist_ok=True)
    # flock-based: the OS drops it when the holder dies, so a killed process never blocks anyone.
    # The lock file itself is never deleted (deleting it races with waiters).
    return FileLock(str(job.dir / ".lock"), timeout=env.LOCK_TIMEOUT_S.value)


def _missing_error(jobs: Sequence[_Job]) -> MissingModuleError:
    names = ", ".join(j.module.name for j in jobs)
    return MissingModuleError(
        f"ATTNFORGE_DISABLE_JIT=1 and {names} is not in the cache ({env.CACHE_DIR.value}). "
        "Prebuild it with `python -m attnforge build --spec-file specs.json` (or a preset: "
        "`python -m attnforge build --preset <name>`) on a machine with nvcc, using the same "
        "ATTNFORGE_CACHE_DIR and arch list, or unset ATTNFORGE_DISABLE_JIT.")


def build(module: JitModule, archs: tuple[str, ...] | None = None) -> Path:
    """Return the path of the module's artifact, building it if needed."""
    return build_many([module], archs)[0]


def build_many(modules: Sequence[JitModule], archs: tuple[str, ...] | None = None) -> list[Path]:
    """Build several modules in one parallel ninja run (subninja), each under its own lock."""
    archs = archs or arch.arch_list()
    jobs = [_Job(m, m.archs or archs) for m in modules]
    todo = [j for j in jobs if not j.is_valid()]
    if not todo:
        return [j.artifact for j in jobs]
    if env.DISABLE_JIT.value:
        raise _missing_error(todo)
    # Sorted lock order: two processes building overlapping sets cannot deadlock.
    todo = sorted({str(j.dir): j for j in todo}.values(), key=lambda j: str(j.dir))
    locks = [_lock(j) for j in todo]
    try:
        for lk, j in zip(locks, todo):
            try:
                lk.acquire()
            except Timeout:
                raise JitBuildError(f"timed out after {env.LOCK_TIMEOUT_S.value:.0f} s waiting for another "
                                    f"process building {j.dir}; raise ATTNFORGE_LOCK_TIMEOUT if builds "
                                    "are that slow") from None
        todo = [j for j in todo if not j.is_valid()]  # re-check: someone may have built it meanwhile
        if todo:
            _build_locked(todo)
    finally:
        for lk in locks:
            if lk.is_locked:
                lk.release()
    return [j.artifact for j in jobs]


def _build_locked(todo: list[_Job]) -> None:
    what = todo[0].module.name if len(todo) == 1 else f"{len(todo)} modules"
    archs = sorted({a for j in todo for a in j.archs})
    log.info("attnforge: building %s for %s with nvcc %s ...", what, " ".join(archs), arch.nvcc_version())
    t0 = time.perf_counter()
    for j in todo:
        j.write_sources()
    if len(todo) == 1:
        build_file = todo[0].dir / "build.ninja"
    else:
        top = env.CACHE_DIR.value / __version__ / ".aot"
        top.mkdir(parents=True, exist_ok=True)
        build_file = top / f"build-{os.getpid()}.ninja"
        _atomic_write(build_file, "".join(f"subninja {j.dir / 'build.ninja'}\n" for j in todo).encode())
    _run_ninja(build_file, what, [j.dir / "kernel.cu" for j in todo])
    seconds = time.perf_counter() - t0
    for j in todo:
        if not j.artifact.is_file():
            raise JitBuildError(f"ninja reported success but {j.artifact} is missing")
        j.write_manifest(seconds)
    log.info("attnforge: built %s in %.1f s -> %s", what, seconds,
             todo[0].dir if len(todo) == 1 else todo[0].dir.parent)


def cache_root() -> Path:
    return env.CACHE_DIR.value


def cache_size_bytes() -> int:
    root = cache_root()
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) if root.exists() else 0
