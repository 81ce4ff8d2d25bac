// Two warpgroups' wgmma streams on one SM: overlapped, alternated, or one alone (benchmarks/micro_wgmma_overlap.py).
// Why: what slows the MLA roles kernel's S (1739 cycles a tile against 1152 of tensor work), the other
// warpgroup's wgmmas or the tiles landing, and whether TMA boxes land as fast as cp.async (perf-notes,
// thirty-first section: overlap costs nothing, cp.async landing costs S ~20%, TMA ~1%).
// Each warpgroup runs `batches` batches of one kind, as in the roles kernel (operands in sw128 shared tiles):
//   kind 0, S:   36 x m64n64k16, A = Q [64 x 576] and B = K [64 x 576], both K-major  (147 KB read a batch)
//   kind 1, P.V:  4 x m64n256k16, A = P [64 x 64] K-major, B = V [64 x 256] MN-major  (40 KB read a batch)
//   kind 2, copies (warpgroup 1 only): one [64 x 576] tile (72 KB) by cp.async from global memory into
//           K2's place, as the roles kernel's refills land beside S (a ring of tiles larger than L2), each
//           warp's requests along the tile's rows (contiguous 512 bytes)
//   kind 3, the same tile by TMA: nine [64 tokens x 64] column-block boxes (the `tma` field's refills)
//   kind 4, the same tile by cp.async in the boxes' order: column block by column block (each warp's
//           requests 128 bytes from each of four rows), to tell the copy engine from the request order
//   kind 5, prefill S:   8 x m64n128k16, A = Q [64 x 128] and B = K [128 x 128], both K-major: the Hopper
//           prefill kernel's S(t+1) at head_dim 128 for one consumer warpgroup (512 tensor cycles at peak)
//   kind 6, prefill P.V: 8 x m64n128k16, A = P from registers, B = V [128 x 128] MN-major: its P.V
// Warpgroup 0 runs kind0 (0 or 5: S) and reads Q and K; warpgroup 1 runs kind1 and reads Q and K2 (S),
// or P and V (P.V; prefill P.V: V in K2's place): 216 KB of shared memory.
#include "attnforge/cp_async.cuh"
#include "attnforge/mbarrier.cuh"
#include "attnforge/tma.cuh"
#include "attnforge/wgmma.cuh"

using namespace attnforge;

constexpr int kTile = 64 * 576 * 2;                 // one [64 x 576] bf16 operand: 72 KB
constexpr int kModeWg0 = 1, kModeWg1 = 2, kModeAlternate = 4;

struct OverlapParams {
  TensorMap map;      // kind 3: the ring as [pages][64 tokens][576] (attnforge/jit/tma.py's paged box)
  long long* cycles;  // [CTAs][2]: each warpgroup's loop, in SM cycles (0: it did not run)
  float* sink;        // keeps the accumulators live
  const char* src;    // kinds 2-4: [CTAs][ring] tiles to copy from
  int batches, mode, kind1;
  int ring;           // tiles a CTA copies from in turn: the whole ring is ~10x the L2, whatever the CTAs
  int kind0;          // warpgroup 0's kind: 0 (MLA S; wgmma_overlap_kernel) or 5 (prefill S; the _prefill_ kernel)
};

// One batch: the issues `issue_all` makes, committed and waited for, with the accumulators fenced after.
template <int N, class Issue>
AF_DEVICE void wgmma_batch(float (&acc)[N], Issue issue_all) {
  wgmma_fence();
  issue_all();
  wgmma_commit();
  wgmma_wait<0>();
  fence_accumulators(acc);
}

AF_DEVICE void s_batch(uint32_t q, uint32_t k, float (&s)[32]) {
  wgmma_batch(s, [&] {
#pragma unroll
    for (int kb = 0; kb < 36; ++kb)
      wgmma_ss<64, bf16>(s, sw128_kmajor_desc(q, 64, kb), sw128_kmajor_desc(k, 64, kb), kb > 0);
  });
}

AF_DEVICE void pv_batch(uint32_t p, uint32_t v, float (&o)[128]) {
  wgmma_batch(o, [&] {
#pragma unroll
    for (int kb = 0; kb < 4; ++kb)
      wgmma_ss_tb<256, bf16>(o, sw128_kmajor_desc(p, 64, kb), sw128_mnmajor_desc(v, 64, kb), 1);
  });
}

AF_DEVICE void prefill_s_batch(uint32_t q, uint32_t k, float (&s)[64]) {  // S [64 x 128] = Q . K^T
  wgmma_batch(s, [&] {
#pragma unroll
    for (int kb = 0; kb < 8; ++kb)
      wgmma_ss<128, bf16>(s, sw128_kmajor_desc(q, 64, kb), sw128_kmajor_desc(k, 128, kb), kb > 0);
  });
}

AF_DEVICE void prefill_pv_batch(const uint32_t (&pa)[8][4], uint32_t v, float (&o)[64]) {  // O [64 x 128] += P . V
  wgmma_batch(o, [&] {
#pragma unroll
    for (int kb = 0; kb < 8; ++kb) wgmma_rs_tb<128, bf16>(o, pa[kb], sw128_mnmajor_desc(v, 128, kb), 1);
  });
}

// Warpgroup 1, kinds 2 and 4: tile b of its ring into shared memory by 16-byte cp.async (36 a thread),
// landed; kind 4 walks it column block by column block (chunk c of token t of block k: t * 72 + 8k + c).
AF_DEVICE void copy_batch(const char* src, int ring, uint32_t dst, int b, bool by_block) {
  const char* tile = src + (int64_t(blockIdx.x) * ring + b % ring) * kTile;
#pragma unroll 4
  for (int i = threadIdx.x % 128; i < kTile / 16; i += 128) {
    const int chunk = by_block ? (i % 512) / 8 * 72 + (i / 512) * 8 + i % 8 : i;
    cp_async_16_at(dst + 16 * chunk, tile + 16 * chunk, true);
  }
  cp_async_commit();
  cp_async_wait<0>();
}

// Warpgroup 1, kind 3: tile b as nine TMA boxes issued by one thread; the warpgroup waits for them.
AF_DEVICE void tma_batch(const TensorMap* map, int ring, uint32_t dst, uint32_t bar, int b) {
  if (threadIdx.x % 128 == 0) {
    mbar_expect_tx(bar, kTile);
    for (int k = 0; k < 9; ++k) tma_load_4d(dst + k * 64 * 128, map, 64 * k, 0, 0, blockIdx.x * ring + b % ring, bar);
    mbar_arrive(bar);
  }
  mbar_wait(bar, b & 1);
}

// kPrefill: the prefill kinds' accumulators (S and O [64 x 128], P's fragments) instead of MLA's: one
// kernel holding both sets would pass 255 registers and serialise its wgmmas (C7512).
template <bool kPrefill>
AF_DEVICE void overlap_body(const OverlapParams& p) {
  extern __shared__ __align__(1024) char smem_raw[];
  char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  // finite, nonzero operands (bf16 1.0 and 0.5 alternating): no NaN or denormal paths
  for (int i = threadIdx.x; i < 3 * kTile / 4; i += 256) reinterpret_cast<uint32_t*>(smem)[i] = 0x3F003F80u;
  const uint32_t bar = smem_addr(smem + 3 * kTile);  // kind 3's barrier, past the three tiles
  if (threadIdx.x == 0) mbar_init(bar, 1);
  __syncthreads();
  const int wg = threadIdx.x / 128;
  const bool runs = p.mode & (wg == 0 ? kModeWg0 : kModeWg1), alternate = p.mode & kModeAlternate;
  const uint32_t q = smem_addr(smem), k = q + kTile, k2 = q + 2 * kTile;
  constexpr int kS = kPrefill ? 64 : 32, kO = kPrefill ? 64 : 128;
  float s[kS] = {}, o[kO] = {};
  uint32_t pa[8][4];  // prefill P.V's A fragments: bf16 0.5 and 1.0, as the tiles hold
#pragma unroll
  for (int kb = 0; kb < 8; ++kb)
#pragma unroll
    for (int h = 0; h < 4; ++h) pa[kb][h] = 0x3F003F80u;
  long long t0 = 0, t1 = 0;
  if (runs) {
    t0 = sm_clock();
    for (int b = 0; b < p.batches; ++b) {
      // alternate: warpgroup 0's batch b (barrier 1: done), then warpgroup 1's (barrier 2: done), then b + 1
      if (alternate && (wg == 1 || b > 0)) named_bar_sync(wg == 0 ? 2 : 1, 256);
      const int kind = wg == 0 ? p.kind0 : p.kind1;
      if constexpr (kPrefill) {
        if (kind == 6) prefill_pv_batch(pa, k2, o);
        else prefill_s_batch(q, wg == 0 ? k : k2, s);
      } else {
        if (kind == 0) s_batch(q, wg == 0 ? k : k2, s);
        else if (kind == 1) pv_batch(q, k2, o);
        else if (kind == 3) tma_batch(&p.map, p.ring, k2, bar, b);
        else copy_batch(p.src, p.ring, k2, b, kind == 4);
      }
      if (alternate) named_bar_arrive(wg == 0 ? 1 : 2, 256);
    }
    if (alternate && wg == 0) named_bar_sync(2, 256);  // warpgroup 1's last batch: the pair's time
    t1 = sm_clock();
  }
  if (threadIdx.x % 128 == 0) p.cycles[2 * blockIdx.x + wg] = t1 - t0;
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < kS; ++i) acc += s[i];
#pragma unroll
  for (int i = 0; i < kO; ++i) acc += o[i];
  if (acc == 12345.f) p.sink[threadIdx.x] = acc;
}

extern "C" __global__ void __launch_bounds__(256, 1) wgmma_overlap_kernel(const __grid_constant__ OverlapParams p) {
  overlap_body<false>(p);
}

// kinds 5 and 6 (kind0 5, kind1 5 or 6)
extern "C" __global__ void __launch_bounds__(256, 1) wgmma_overlap_prefill_kernel(const __grid_constant__ OverlapParams p) {
  overlap_body<true>(p);
}
