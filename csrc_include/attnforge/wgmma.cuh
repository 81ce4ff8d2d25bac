// attnforge/wgmma.cuh: warpgroup tensor-core MMA (sm_90a) over 128-byte-swizzled shared tiles.
//
// Shared-memory tile format ("sw128"), the one every wgmma operand here uses: a [rows x W] tile of
// 16-bit values is stored as W/64 column blocks, each [rows][64] (128-byte rows); in each block,
// 16-byte chunk c of row r sits at chunk c ^ (r % 8). Blocks are 1024-byte aligned, so the
// hardware's 128B swizzle (address bits 4-6 ^= bits 7-9) reads exactly this layout.
//   As a K-major operand ([M or N rows][K]), one k16 step is 32 bytes into a block: start address
//   + (k % 64) * 2, stride between 8-row groups (SBO) 1024 bytes, LBO unused.
//   As an MN-major B operand ([K rows][N]: V in P.V), one k16 step is 16 rows = 2048 bytes in;
//   SBO 1024 bytes (8 K rows), LBO = one column block's bytes (the next 64 N columns).
//
// Accumulators of m64nN (f32, N/2 per thread): warp w of the warpgroup owns rows 16w..16w+15, and
// within them the mma.sync m16n8 layout per n8 column chunk j (g = lane / 4, c = lane % 4):
//   d[4j + 0, 1] -> (row g,     cols 8j + 2c, +1)     d[4j + 2, 3] -> (row g + 8, cols 8j + 2c, +1)
// A from registers (RS form) is the mma.sync m16k16 A fragment of the warp's 16 rows.
#pragma once
#include "attnforge/common.cuh"
#include "attnforge/cp_async.cuh"  // sw128_offset
#include "attnforge/wgmma_ops.cuh"

namespace attnforge {

// Shared-memory matrix descriptor, 128B swizzle (layout type 1 in bits 62-63). The start address
// field is bits 0-13 of addr >> 4: a CTA's shared addresses are below 2^18 (228 KB windows), so no
// mask is needed, and a step within a tile is one 32-bit add to the low word (desc_advance) instead
// of shift, mask and merge per wgmma (~5 instructions each on the consumers' critical path).
AF_HOST_DEVICE uint64_t sw128_desc(uint32_t smem_addr, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  return uint64_t(smem_addr >> 4) | (uint64_t((lbo_bytes >> 4) & 0x3FFF) << 16) |
         (uint64_t((sbo_bytes >> 4) & 0x3FFF) << 32) | (uint64_t(1) << 62);
}
// `desc` moved `bytes` (a multiple of 16) further into the same window: the address field cannot
// carry out of the low word (start + bytes < 2^18), so the high word is untouched.
AF_HOST_DEVICE uint64_t desc_advance(uint64_t desc, uint32_t bytes) {
  return (desc & 0xFFFFFFFF00000000ull) | uint32_t(uint32_t(desc) + (bytes >> 4));
}

// Descriptor of k16 step `k` of a K-major sw128 operand of `rows` rows starting at `tile`.
AF_HOST_DEVICE uint64_t sw128_kmajor_desc(uint32_t tile, int rows, int k) {
  return desc_advance(sw128_desc(tile, 16, 1024), (k / 4) * rows * 128 + (k % 4) * 32);
}
// Descriptor of k16 step `k` (rows 16k..16k+15) of an MN-major sw128 B operand of `rows` rows.
AF_HOST_DEVICE uint64_t sw128_mnmajor_desc(uint32_t tile, int rows, int k) {
  return desc_advance(sw128_desc(tile, rows * 128, 1024), k * 16 * 128);
}

// Row maxima of a thread's m64nN accumulators (rows g and g + 8, layout above) as four independent
// FMNMX chains per row joined at the end: one serial chain of N/4 per row lay on the path from the
// S wait to the P.V issue (~4 cycles a step), the tree leaves N/16 + 2 steps.
template <int N>
AF_DEVICE void accumulator_row_max(const float (&d)[N], float (&m)[2]) {
  static_assert(N % 8 == 0, "two n8 chunks or more");
  float part[2][4];  // [row][chain]: chain k takes the k % 2 column of every other n8 chunk
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int k = 0; k < 4; ++k) part[r][k] = d[4 * (k / 2) + 2 * r + k % 2];
#pragma unroll
  for (int j = 2; j < N / 4; ++j)
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int e = 0; e < 2; ++e) part[r][2 * (j % 2) + e] = fmaxf(part[r][2 * (j % 2) + e], d[4 * j + 2 * r + e]);
#pragma unroll
  for (int r = 0; r < 2; ++r) m[r] = fmaxf(fmaxf(part[r][0], part[r][1]), fmaxf(part[r][2], part[r][3]));
}

// stmatrix (sm_90): four 8x8 b16 matrices, each held one 32-bit pair per lane in the mma accumulator
// order (lane l: row l / 4, columns 2(l % 4), +1); lane l gives the address of row l % 8 of matrix l / 8.
AF_DEVICE void stmatrix_x4(uint32_t addr, uint32_t m0, uint32_t m1, uint32_t m2, uint32_t m3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
               ::"r"(addr), "r"(m0), "r"(m1), "r"(m2), "r"(m3) : "memory");
}

// A warp's rows [row0, row0 + 16) x 16-byte chunks [chunk0, chunk0 + N) of packed 16-bit pairs, in
// the m16n8 accumulator order (pk[2j]: row g, pk[2j + 1]: row g + 8 of chunk chunk0 + j), into an
// sw128 tile of `rows` rows: one stmatrix per two chunks instead of four 32-bit stores per chunk
// (with their swizzled addresses), on the softmax's path to the P.V issue.
template <int N>
AF_DEVICE void store_pairs_sw128(uint32_t tile, int row0, int chunk0, int rows, const uint32_t (&pk)[2 * N]) {
  static_assert(N % 2 == 0, "chunks go in pairs: matrices (rows 0-7 | 8-15) x (chunk j | j + 1)");
  const int lane = threadIdx.x % 32, row = row0 + (lane / 8 % 2) * 8 + lane % 8;  // this lane's matrix row
#pragma unroll
  for (int j = 0; j < N; j += 2)
    stmatrix_x4(tile + sw128_offset(row, chunk0 + j + lane / 16, rows), pk[2 * j], pk[2 * j + 1], pk[2 * j + 2],
                pk[2 * j + 3]);
}

// Ordering: fence before the first wgmma that reads registers written by ordinary code;
// commit closes a group; wait<N> leaves at most N groups in flight.
AF_DEVICE void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
AF_DEVICE void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
AF_DEVICE void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

// Pins accumulators after wgmma_wait: the compiler sees them rewritten here, so no read of an
// accumulator moves above the wait (the asm that issued the wgmma "wrote" them long before).
template <int N>
AF_DEVICE void fence_accumulators(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// The same for registers an ordinary instruction wrote and a wgmma reads next (accumulators, A
// fragments): placed before wgmma_fence(), the writes cannot sink below it.
template <int N>
AF_DEVICE void fence_registers(uint32_t (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// Ordinary shared-memory writes (st.shared, cp.async) -> reads by the async proxy (wgmma, TMA).
AF_DEVICE void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

}  // namespace attnforge
