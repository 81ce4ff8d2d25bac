"""Parameter fields shared by the kernel families (each family's struct adds its own)."""
from __future__ import annotations

from ..codegen import ParamField


def ptrs(*names: str, cpp: str = "const int32_t*") -> tuple:
    return tuple(ParamField(n, cpp, "ptr") for n in names)


def scalars(kind: str, cpp: str, *names: str) -> tuple:
    return tuple(ParamField(n, cpp, kind) for n in names)


# q, the cache (or ragged K/V), the output and its optional LSE
IO_FIELDS = (*ptrs("q", "k_cache", "v_cache", cpp="const void*"), ParamField("out", "void*", "ptr"),
             ParamField("lse", "float*", "ptr"))
# a paged (or ragged) KV layout: page table, lengths and element strides (attnforge/paged_kv.cuh)
PAGED_KV_FIELDS = (*ptrs("kv_indptr", "kv_indices", "kv_len"),
                   *scalars("i64", "int64_t", "stride_page", "stride_token", "stride_head"),
                   ParamField("page_size", "int32_t", "i32"))
