// attnforge/paged_kv.cuh: addressing of a paged KV cache through a CSR page table.
//
// Element (page, token-in-page, head, dim) sits at page*stride_page + tok*stride_token +
// head*stride_head + dim, so NHD, HND, a [P, 2, ...] cache and a (K, V) pair share one code path.
#pragma once
#include "attnforge/common.cuh"

namespace attnforge {

// Page-table slot of token `pos`: a shift for power-of-two pages (ragged KV's one huge page too),
// sparing the ~20-instruction integer division on the hot path.
AF_DEVICE int32_t page_slot(int32_t pos, int32_t page_size) {
  return (page_size & (page_size - 1)) == 0 ? pos >> (__ffs(page_size) - 1) : pos / page_size;
}

struct PagedKV {
  const int32_t* page_ids;  // this request's pages: kv_indices + kv_indptr[request]
  int64_t stride_page, stride_token, stride_head;
  int32_t page_size;
  int64_t token_base = 0;  // ragged (unpaged) KV: the request's first token, one huge "page"

  AF_DEVICE int32_t page_of(int32_t pos) const { return page_slot(pos, page_size); }
  // A page-table entry: a plain (coherent) load, not __ldg, since under PDL the kernel before this one
  // may write the table (Quest's select: load_after_wait in common.cuh says why)
  AF_DEVICE int32_t page_id(int32_t slot) const { return page_ids[slot]; }

  // Offset (in elements) of token `pos` of the request, head `head`, dim 0.
  AF_DEVICE int64_t offset(int32_t pos, int32_t head) const {
    const int32_t slot = page_of(pos);  // page-table entry read once per row per tile
    const int32_t in_page = pos - slot * page_size;
    return token_base + int64_t(page_id(slot)) * stride_page + int64_t(in_page) * stride_token +
           int64_t(head) * stride_head;
  }
};

}  // namespace attnforge
