// attnforge/cp_async.cuh: asynchronous 16-byte global->shared copies (sm_80+), with zero fill.
#pragma once
#include "attnforge/common.cuh"

namespace attnforge {

AF_DEVICE uint32_t smem_addr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// Each copy asks L2 to fetch the 128 bytes around its sector from DRAM (streaming KV reads whole lines).
// Measured on the H200 (docs/perf-notes.md, thirty-seventh session): 256 bytes lost on every decode case
// (+0.7..+6.1%) and at MLA h8 / h16 (+3.5..+5.9%); no hint lost at MLA h16 (+3.0..+5.4%) and tied elsewhere.
#define AF_CP_ASYNC_16 "cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n"

// Copies 16 bytes, or writes 16 zero bytes when !valid (rows past the end of a chunk), so the
// tile never holds stale data from an earlier stage.
AF_DEVICE void cp_async_16(void* smem, const void* gmem, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile(AF_CP_ASYNC_16 ::"r"(smem_addr(smem)), "l"(gmem), "r"(src_bytes));
}
// The same, to a shared-memory address already in the 32-bit shared window (offsets fold into the
// instruction's immediate when the caller adds constants).
AF_DEVICE void cp_async_16_at(uint32_t smem, const void* gmem, bool valid) {
  asm volatile(AF_CP_ASYNC_16 ::"r"(smem), "l"(gmem), "r"(valid ? 16 : 0));
}
AF_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
AF_DEVICE void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// XOR swizzle of 16-byte chunks within a row: rows 8 apart share banks, so chunk c of row r
// lives at c ^ (r % 8); ldmatrix's 8 row addresses then hit 8 distinct bank groups.
AF_HOST_DEVICE constexpr int swizzle(int row, int chunk) { return chunk ^ (row & 7); }

// The sw128 tile format of attnforge/wgmma.cuh: byte offset of 16-byte chunk `chunk` (along the
// row) of row `row` in a tile of `rows` rows, stored as 64-column blocks of 128-byte rows.
AF_HOST_DEVICE constexpr int sw128_offset(int row, int chunk, int rows) {
  return (chunk >> 3) * rows * 128 + row * 128 + (swizzle(row, chunk & 7) << 4);
}

}  // namespace attnforge
