"""One module per kernel family: spec -> JitModule (template variables, params layout, launch shape)."""
from __future__ import annotations

from ..jit import JitModule
from ..spec import AttentionSpec


def module_for_attention(spec: AttentionSpec) -> JitModule:
    if spec.family == "decode":
        from .decode import DecodeKernel
        return DecodeKernel(spec).module()
    if spec.family == "prefill":
        from .prefill import PrefillKernel, default_backend
        return PrefillKernel(spec, default_backend(spec)).module()
    if spec.family == "mla_decode":
        from .mla import MLADecodeKernel
        return MLADecodeKernel(spec).module()
    raise NotImplementedError(f"kernel family {spec.family!r} is not implemented yet; "
                              "available: 'decode', 'prefill', 'mla_decode'")
