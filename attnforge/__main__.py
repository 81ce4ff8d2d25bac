"""python -m attnforge {demo, build, info, cache list, cache clear}."""
from __future__ import annotations

import argparse
import shutil
import sys


def _cmd_build(args) -> int:
    from . import presets
    from .jit import build_many
    specs = []
    for name in args.preset or []:
        if name not in presets.PRESETS:
            print(f"unknown preset {name!r}; choose from {sorted(presets.PRESETS)}", file=sys.stderr)
            return 2
        specs += presets.PRESETS[name]()
    for path in args.spec_file or []:
        try:
            specs += presets.load_spec_file(path)
        except (OSError, ValueError) as e:  # a missing file, bad JSON or a bad spec: the reason, not a traceback
            print(f"python -m attnforge build: {e}", file=sys.stderr)
            return 2
    if not specs:
        print("nothing to build: pass --preset NAME or --spec-file FILE", file=sys.stderr)
        return 2
    per_spec = [presets.modules_for(s) for s in specs]
    paths = iter(build_many([m for mods in per_spec for m in mods]))
    for s, mods in zip(specs, per_spec):
        for m in mods:
            print(f"{s.name}: {next(paths)}" if len(mods) == 1 else f"{s.name} ({m.name}): {next(paths)}")
    return 0


def _cmd_info(_args) -> int:
    import torch

    from . import __version__
    from .jit import arch, builder, env
    print(f"attnforge {__version__}")
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda})")
    try:
        print(f"nvcc {arch.nvcc_version_full()} at {arch.nvcc_path()}")
    except Exception as e:  # no toolkit is a legitimate state for `info`
        print(f"nvcc: not available ({e})")
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        print(f"GPU {p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs")
    else:
        print("GPU: none visible")
    print(f"arch list: {' '.join(arch.arch_list())}")
    size = builder.cache_size_bytes()
    print(f"cache: {builder.cache_root()} ({size / 2**20:.1f} MiB)")
    for k in env.ALL_KNOBS:
        print(f"  {k.name}={k.value}")
    return 0


def _cmd_cache(args) -> int:
    from .jit import builder
    root = builder.cache_root()
    if args.action == "clear":
        shutil.rmtree(root, ignore_errors=True)
        print(f"cleared {root}")
    elif args.action == "list":
        _list_cache(root)
    return 0


def _list_cache(root) -> None:
    """Every cached module: its kernels' registers per thread and stack frame (spills show as a frame)."""
    from .jit.cubin import kernel_resources
    artifacts = sorted(root.rglob("kernel.cubin")) if root.exists() else []
    for path in artifacts:
        try:
            res = kernel_resources(path.read_bytes())
            detail = ", ".join(f"{fn} {r.registers} registers, stack {r.frame_bytes} B"
                               for fn, r in sorted(res.items()))
        except ValueError:  # a multi-arch image: no single .nv.info to read
            detail = "(not a single-arch cubin)"
        print(f"{path.parent.relative_to(root)}: {detail}")
    print(f"{len(artifacts)} modules in {root}")


def _cmd_demo(_args) -> int:
    from .demo import main
    return main()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m attnforge", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("demo", help="build a decode kernel, run it and check it against the reference")
    b = sub.add_parser("build", help="prebuild specs in one parallel ninja run (AOT)")
    b.add_argument("--preset", action="append", help="named spec list (see attnforge.presets)")
    b.add_argument("--spec-file", action="append", help="JSON list of AttentionSpec dicts")
    sub.add_parser("info", help="versions, GPU, nvcc, cache location and size")
    c = sub.add_parser("cache", help="manage the kernel cache")
    c.add_argument("action", choices=["list", "clear"], help="list: modules with registers and stack; clear: delete")
    args = ap.parse_args(argv)
    return {"demo": _cmd_demo, "build": _cmd_build, "info": _cmd_info, "cache": _cmd_cache}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
