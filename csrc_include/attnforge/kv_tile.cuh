// attnforge/kv_tile.cuh: pipelined loads of K/V tiles from a paged cache into shared memory.
//
// Tile layout in shared memory, per matrix (K, then V):  [kTileKV rows][kHeadDim] elements.
//   16-bit KV: chunk c of row r stored at c ^ (r % 8) (swizzle: conflict-free ldmatrix).
//   fp8 KV:    stored plain, then widened by widen() into a swizzled 16-bit tile; or stored
//              swizzled (kSwizzleFp8, fp8_swizzle) for kernels that widen in registers after ldmatrix,
//              and for widen_sw128 (the wgmma prefill producer) at 128-byte rows.
// Thread t copies 16-byte chunk (t % kChunks) of rows t / kChunks + j * kRowStep; with kWarpRows, warp
// w copies rows [w * kTileKV / warps, (w + 1) * kTileKV / warps) alone (lane l: chunk l % kChunks of
// rows l / kChunks + j * 32 / kChunks in that band), so a kernel whose warps each read only their own
// band of the tile can wait for it with __syncwarp instead of a CTA barrier. Page ids are
// fetched one tile ahead (Pages), so no cp.async waits on a page-table load, and resolved once per
// row, not per 16-byte chunk: lane q of a warp owns the warp's q-th row (page id, then its offset),
// and shuffles hand that offset to the lanes that copy the row's chunks (the per-chunk page lookup
// and 64-bit offset math had been ~480 of the MQA decode kernel's ~1400 instructions a warp a tile).
// Sw128KVLoader writes the same rows in the sw128 format of attnforge/wgmma.cuh instead (wgmma operands).
#pragma once
#include "attnforge/common.cuh"
#include "attnforge/cp_async.cuh"
#include "attnforge/paged_kv.cuh"

namespace attnforge {

template <class T, int kHeadDim>
AF_DEVICE T* swizzled_row(T* base, int row, int chunk) {  // 16-bit tile: kHeadDim / 8 chunks per row
  return base + row * kHeadDim + swizzle(row, chunk) * 8;
}

// This lane's ldmatrix.x4 address of an m16k16 A fragment of a swizzled 16-bit tile: rows
// [16 tile, 16 tile + 16), dims [16 kk, 16 kk + 16) (the mma kernels' Q fragments).
template <class T, int kHeadDim>
AF_DEVICE uint32_t a_frag_addr(T* base, int tile, int lane, int kk) {
  return smem_addr(swizzled_row<T, kHeadDim>(base, tile * 16 + (lane % 8) + ((lane / 8) % 2) * 8, kk * 2 + lane / 16));
}

// Half `half` of 16 e4m3 values (values 8 half .. 8 half + 7) as a 16-byte chunk of T: one cvt a pair
// (bf16: through f32).
template <class T>
AF_DEVICE void widen_half(const uint4& raw, int half, uint4& out) {
  uint32_t o[4];
  fp8x8_to<T>(raw, half, o);
  out = make_uint4(o[0], o[1], o[2], o[3]);
}

// Where a swizzled fp8 row (kSwizzleFp8) stores its 16-byte chunk `chunk`: as 16-bit rows do (chunk ^ row % 8)
// at 8 or more chunks a row; at 4 (head_dim 64: two 64-byte rows a 128-byte bank line) chunk ^ (row / 2) % 4,
// so the 8 rows an ldmatrix phase reads still fall in 8 distinct 16-byte bank groups.
template <int kChunks>
AF_HOST_DEVICE constexpr int fp8_swizzle(int row, int chunk) {
  static_assert(kChunks >= 4, "fp8 rows of at least 64 bytes");
  return kChunks >= 8 ? swizzle(row, chunk) : chunk ^ ((row >> 1) & 3);
}

// fp8_swizzle keeps each row's chunks in the row (a permutation of them), and an ldmatrix phase (8 rows
// r0..r0+7, r0 a multiple of 8, one logical chunk each) touches 8 distinct 16-byte bank groups.
template <int kChunks>
AF_HOST_DEVICE constexpr bool fp8_swizzle_holds() {
  for (int r = 0; r < 16; ++r) {
    int seen = 0;
    for (int c = 0; c < kChunks; ++c) seen |= 1 << fp8_swizzle<kChunks>(r, c);
    if (seen != (1 << kChunks) - 1) return false;
  }
  for (int r0 = 0; r0 < 16; r0 += 8)
    for (int c = 0; c < kChunks; ++c) {
      int banks = 0;
      for (int r = r0; r < r0 + 8; ++r) banks |= 1 << ((r * kChunks + fp8_swizzle<kChunks>(r, c)) % 8);
      if (banks != 0xff) return false;
    }
  return true;
}

// kSwizzleFp8: fp8 rows stored swizzled (fp8_swizzle), for kernels that ldmatrix the fp8 tile directly and
// widen in registers instead of calling widen(), and for widen_sw128 at 128-byte rows (conflict-free loads).
template <class TKV, class TMma, int kHeadDim, int kTileKV, int kThreads, bool kSwizzleFp8 = false,
          bool kWarpRows = false>
struct KVTileLoader {
  static constexpr bool kFp8 = sizeof(TKV) == 1;
  static constexpr int kElems = 16 / sizeof(TKV);
  static constexpr int kChunks = kHeadDim / kElems;  // 16-byte chunks per stored row
  static constexpr int kRowStep = kThreads / kChunks;
  static constexpr int kRowsPerThread = kTileKV / kRowStep;
  static constexpr int kTileBytes = kTileKV * kHeadDim * int(sizeof(TKV));  // one matrix
  static constexpr int kBandRows = kTileKV / (kThreads / 32);  // kWarpRows: one warp's band
  static_assert(kThreads % kChunks == 0 && kTileKV % kRowStep == 0, "tile/thread mapping");
  static_assert(!kSwizzleFp8 || (kFp8 && kChunks >= 4), "a swizzled fp8 row needs 4 or more 16-byte chunks");
  static_assert(!kSwizzleFp8 || fp8_swizzle_holds<kSwizzleFp8 ? kChunks : 8>(),  // (16-bit rows: not instantiated)
                "fp8_swizzle: a chunk outside its row or a bank conflict");
  static_assert(!kWarpRows || (32 % kChunks == 0 && kBandRows % (32 / kChunks) == 0), "warp band mapping");

  // The rows a warp copies, as warp-local indices q: thread (lane L, j) copies row q = j * kRowsPerJ +
  // L / kChunks, which lane q % 32 resolves (slot q / 32: more than 32 rows a warp take two or more).
  static constexpr int kRowsPerJ = 32 / kChunks;
  static constexpr int kWarpRowCount = kRowsPerThread * kRowsPerJ;
  static constexpr int kResolveSlots = (kWarpRowCount + 31) / 32;
  static_assert(32 % kChunks == 0, "a warp copies whole rows per j (16-byte chunks a row: 1 to 32)");

  // The mapping, as constexpr functions of the thread index t (unsigned, as threadIdx: shifts, not
  // signed division), so mapping_holds() can check it
  static constexpr int chunk_of(unsigned t) { return int(t % kChunks); }
  static constexpr int row_of(unsigned t, int j) {  // thread t's j-th row of the tile
    if (kWarpRows) return int(t / 32 * kBandRows + t % 32 / kChunks) + j * kRowsPerJ;
    return int(t / kChunks) + j * kRowStep;
  }
  static constexpr int warp_row_of(unsigned w, int q) {  // the tile row of warp w's q-th
    if (kWarpRows) return int(w * kBandRows) + q;
    return int(w * kRowsPerJ) + q % kRowsPerJ + q / kRowsPerJ * kRowStep;
  }
  // Every (row, chunk) of the tile is copied by exactly one (thread, j), and the lane that resolves a
  // thread's j-th row (q = j * kRowsPerJ + lane / kChunks, in the thread's own warp) names that row.
  static constexpr bool mapping_holds() {
    bool seen[kTileKV * kChunks] = {};
    for (unsigned t = 0; t < unsigned(kThreads); ++t)
      for (int j = 0; j < kRowsPerThread; ++j) {
        const int r = row_of(t, j), q = j * kRowsPerJ + int(t % 32 / kChunks);
        if (r < 0 || r >= kTileKV || seen[r * kChunks + chunk_of(t)] || q >= kWarpRowCount ||
            warp_row_of(t / 32, q) != r)
          return false;
        seen[r * kChunks + chunk_of(t)] = true;
      }
    return true;
  }

  static AF_DEVICE int chunk() { return chunk_of(threadIdx.x); }
  static AF_DEVICE int row(int j) { return row_of(threadIdx.x, j); }  // this thread's j-th row of the tile
  static AF_DEVICE int warp_row(int q) { return warp_row_of(threadIdx.x / 32, q); }

  struct Pages {  // this lane's resolved rows (warp-local q = lane + 32 slot), fetched a tile ahead
    int32_t page[kResolveSlots];
    int32_t in_page[kResolveSlots];  // token within the page; -1 past kv_end (zero-filled) or no row
  };

  static AF_DEVICE Pages fetch(const PagedKV& kv, int kv_end, int t0) {
    static_assert(mapping_holds(), "KVTileLoader: a tile row or chunk copied twice or not at all, or a row "
                                   "resolved by a lane that does not own it");
    Pages tp;
#pragma unroll
    for (int r = 0; r < kResolveSlots; ++r) {
      const int q = int(threadIdx.x % 32) + 32 * r;
      const int pos = t0 + warp_row(q);
      const bool valid = q < kWarpRowCount && pos < kv_end;
      const int slot = valid ? kv.page_of(pos) : 0;
      tp.page[r] = valid ? kv.page_id(slot) : 0;
      tp.in_page[r] = valid ? pos - slot * kv.page_size : -1;
    }
    return tp;
  }

  // Element offsets of this lane's resolved rows from their head's base (-1: past kv_end, or none).
  struct RowOffsets {
    int64_t off[kResolveSlots];
  };
  static AF_DEVICE RowOffsets resolve(const PagedKV& kv, const Pages& tp) {
    RowOffsets ro;
#pragma unroll
    for (int r = 0; r < kResolveSlots; ++r)
      ro.off[r] = tp.in_page[r] < 0 ? -1 : int64_t(tp.page[r]) * kv.stride_page + int64_t(tp.in_page[r]) * kv.stride_token;
    return ro;
  }
  // This thread's j-th row's offset, from the lane that resolved it (every lane of the warp must call)
  static AF_DEVICE int64_t row_offset(const RowOffsets& ro, int j) {
    const int q = j * kRowsPerJ + int(threadIdx.x % 32) / kChunks;  // its slot q / 32 is uniform in the warp
    return __shfl_sync(0xffffffffu, ro.off[j * kRowsPerJ / 32], q % 32);
  }

  // cp.async K and V rows of one tile into `stage` (K tile, then V tile). Every lane of each warp
  // takes part (the shuffles): call it under a CTA-uniform condition.
  static AF_DEVICE void load(const TKV* k_cache, const TKV* v_cache, const PagedKV& kv, int kv_head,
                             const Pages& tp, char* stage) {
    const int ch = chunk();
    const int64_t head_off = kv.token_base + int64_t(kv_head) * kv.stride_head + ch * kElems;
    const TKV* k_head = k_cache + head_off;
    const TKV* v_head = v_cache + head_off;
    const RowOffsets ro = resolve(kv, tp);
    const uint32_t sk = smem_addr(stage), sv = sk + kTileBytes;
#pragma unroll
    for (int j = 0; j < kRowsPerThread; ++j) {
      const int64_t off = row_offset(ro, j);
      const bool valid = off >= 0;
      const int r = row(j);
      const int col = !kFp8 ? swizzle(r, ch) : kSwizzleFp8 ? fp8_swizzle<kChunks>(r, ch) : ch;
      const uint32_t dst = (r * kHeadDim + col * kElems) * sizeof(TKV);
      cp_async_16_at(sk + dst, k_head + (valid ? off : 0), valid);
      cp_async_16_at(sv + dst, v_head + (valid ? off : 0), valid);
    }
  }

  // fp8 -> 16-bit for both matrices of a stage, into the swizzled layout the MMA loads expect.
  static AF_DEVICE void widen(const char* stage, TMma* wide) {
    const uint4* src = reinterpret_cast<const uint4*>(stage);
    for (int i = threadIdx.x; i < 2 * kTileKV * kChunks; i += kThreads) {
      const int mat = i / (kTileKV * kChunks), rem = i % (kTileKV * kChunks);
      const int row = rem / kChunks, ch = rem % kChunks;  // one fp8 chunk = 16 values = 2 chunks out
      const uint4 raw = src[i];
      TMma* base = wide + mat * kTileKV * kHeadDim;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        uint4 out;
        widen_half<TMma>(raw, half, out);
        *reinterpret_cast<uint4*>(swizzled_row<TMma, kHeadDim>(base, row, 2 * ch + half)) = out;
      }
    }
  }

  // fp8 -> 16-bit into the sw128 format of attnforge/wgmma.cuh (wgmma operands), K into wide_k and V into
  // wide_v, once the whole tile has landed (the caller's barrier covers every thread's copies and the TMA
  // boxes, so a thread may widen chunks another thread copied). The staging slot holds the tile as
  // load() writes it: 128-byte rows (head_dim 128) swizzled (kSwizzleFp8), 64-byte rows plain.
  // Mapping: a thread keeps one chunk column and rows r0 + kWidenStep j, kWidenStep a multiple of 8, so
  // row % 8, and with it every swizzled position, is fixed per thread: the addresses are computed once
  // and a chunk costs one load, eight cvts and two stores (the per-row address math and selects had
  // been 18 of a chunk's 29 instructions on this instruction-bound warpgroup).
  //   8 chunks a row: quarter-warp q (8 lanes) takes column q % 8 of rows lane % 8 + 8 (q / 8) + 16 j, so
  //     its 8 loads and each of its stores hit 8 distinct bank groups (8 rows, 8 different swizzles).
  //   4 chunks a row: rows t / 4 + 32 j, column t % 4 (a quarter-warp's two rows fill 128 bytes of
  //     staging, and its stores' chunks 2 ch + h, swizzled by an even and an odd row, are 8 distinct).
  // An fp8 chunk (16 values) becomes the wide row's chunks 2 ch and 2 ch + 1. kDiv256: fp16 values / 256
  // by integer ops (e4m3x4_to_f16x4_div256), not the conversion unit's cvt. mats: 1 K, 2 V, 3 both.
  static constexpr bool kWidenByQuarter = kChunks == 8;
  static constexpr int kWidenStep = kWidenByQuarter ? 8 * (kThreads / 64) : kThreads / kChunks;
  static constexpr int widen_chunk_of(unsigned t) { return kWidenByQuarter ? int(t / 8 % 8) : int(t % kChunks); }
  static constexpr int widen_row_of(unsigned t) { return kWidenByQuarter ? int(t % 8 + t / 64 * 8) : int(t / kChunks); }

  // Every (row, chunk) of a matrix is widened exactly once, and within each quarter-warp (one phase of a
  // 16-byte shared access) the 8 loads, and the 8 stores of each half, fall in 8 distinct bank groups.
  static constexpr bool widen_mapping_holds() {
    bool seen[kTileKV * kChunks] = {};
    for (unsigned t = 0; t < unsigned(kThreads); ++t)
      for (int j = 0; j < kTileKV / kWidenStep; ++j) {
        const int r = widen_row_of(t) + j * kWidenStep, c = widen_chunk_of(t);
        if (r >= kTileKV || seen[r * kChunks + c]) return false;
        seen[r * kChunks + c] = true;
      }
    for (unsigned q = 0; q < unsigned(kThreads); q += 8) {
      int loads = 0, stores[2] = {0, 0};  // bit masks of the bank groups (16-byte columns of 128 bytes)
      for (unsigned t = q; t < q + 8; ++t) {
        const int r = widen_row_of(t), c = widen_chunk_of(t);
        loads |= 1 << ((r * kHeadDim + (kSwizzleFp8 ? fp8_swizzle<kChunks>(r, c) : c) * kElems) / 16 % 8);
        for (int h = 0; h < 2; ++h) stores[h] |= 1 << (sw128_offset(r, 2 * c + h, kTileKV) / 16 % 8);
      }
      if (loads != 0xff || stores[0] != 0xff || stores[1] != 0xff) return false;
    }
    return true;
  }

  template <bool kDiv256 = false>
  static AF_DEVICE void widen_sw128(const char* stage, char* wide_k, char* wide_v, int mats = 3) {
    static_assert(kFp8 && (kChunks == 4 || kChunks == 8) && kSwizzleFp8 == (kChunks == 8),
                  "sw128 widening: fp8 rows of 64 bytes (plain) or 128 bytes (swizzled)");
    static_assert(kThreads % 64 == 0 && kWidenStep % 8 == 0 && kTileKV % kWidenStep == 0, "widening mapping");
    static_assert(!kDiv256 || std::is_same_v<TMma, fp16>, "integer widening gives fp16");
    static_assert(widen_mapping_holds(), "widen_sw128: a chunk widened twice or not at all, or a bank conflict");
    const int ch = widen_chunk_of(threadIdx.x), r0 = widen_row_of(threadIdx.x);
    const int src0 = r0 * kHeadDim + (kSwizzleFp8 ? fp8_swizzle<kChunks>(r0, ch) : ch) * kElems;
    const int dst_lo = sw128_offset(r0, 2 * ch, kTileKV), dst_hi = sw128_offset(r0, 2 * ch + 1, kTileKV);
#pragma unroll
    for (int mat = 0; mat < 2; ++mat) {
      if (!(mats & (mat + 1))) continue;
      const char* src = stage + mat * kTileBytes + src0;
      char* wide = mat == 0 ? wide_k : wide_v;
      // head_dim 128: loads in batches of four ahead of their stores (the compiler cannot move a load
      // above a store that may alias it, so each load waited out the shared-memory latency after the last
      // chunk's stores): -7.3% on the whole kernel. head_dim 64 lost 3.4% by it: one at a time there.
      constexpr int kRows = kTileKV / kWidenStep, kBatch = kChunks == 8 ? (kRows < 4 ? kRows : 4) : 1;
#pragma unroll(kBatch == 1 ? 4 : 1)  // (a producer warpgroup's 56 registers)
      for (int j0 = 0; j0 < kRows; j0 += kBatch) {
        uint4 raw[kBatch];
#pragma unroll
        for (int b = 0; b < kBatch; ++b) raw[b] = *reinterpret_cast<const uint4*>(src + (j0 + b) * kWidenStep * kHeadDim);
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          uint4 out[2];  // dims [16 ch, 16 ch + 8) and [16 ch + 8, 16 ch + 16)
          if constexpr (kDiv256) {
            e4m3x4_to_f16x4_div256(raw[b].x, out[0].x, out[0].y);
            e4m3x4_to_f16x4_div256(raw[b].y, out[0].z, out[0].w);
            e4m3x4_to_f16x4_div256(raw[b].z, out[1].x, out[1].y);
            e4m3x4_to_f16x4_div256(raw[b].w, out[1].z, out[1].w);
          } else {
#pragma unroll
            for (int half = 0; half < 2; ++half) widen_half<TMma>(raw[b], half, out[half]);
          }
          *reinterpret_cast<uint4*>(wide + dst_lo + (j0 + b) * kWidenStep * 128) = out[0];
          *reinterpret_cast<uint4*>(wide + dst_hi + (j0 + b) * kWidenStep * 128) = out[1];
        }
      }
    }
  }
};

// The same copies into the sw128 format of attnforge/wgmma.cuh (K and V tiles as wgmma operands).
// 16-bit KV only: wgmma reads the tiles as they land.
template <class TKV, int kHeadDim, int kTileKV, int kThreads>
struct Sw128KVLoader : KVTileLoader<TKV, TKV, kHeadDim, kTileKV, kThreads> {
  using Base = KVTileLoader<TKV, TKV, kHeadDim, kTileKV, kThreads>;
  static_assert(sizeof(TKV) == 2 && kHeadDim % 64 == 0, "sw128 tiles hold 16-bit values in 64-column blocks");
  static constexpr int kKOnly = 1, kVOnly = 2, kBoth = 3;  // the `mats` argument: which matrices to copy

  static AF_DEVICE void load(const TKV* k_cache, const TKV* v_cache, const PagedKV& kv, int kv_head,
                             const typename Base::Pages& tp, char* sk, char* sv) {
    const int ch = threadIdx.x % Base::kChunks;
    const int64_t head_off = kv.token_base + int64_t(kv_head) * kv.stride_head + ch * Base::kElems;
    const typename Base::RowOffsets ro = Base::resolve(kv, tp);
#pragma unroll
    for (int j = 0; j < Base::kRowsPerThread; ++j) {
      const int row = Base::row(j);
      const int64_t ro_j = Base::row_offset(ro, j);
      const bool valid = ro_j >= 0;
      const int dst = sw128_offset(row, ch, kTileKV);
      cp_async_16(sk + dst, k_cache + (valid ? ro_j + head_off : 0), valid);
      cp_async_16(sv + dst, v_cache + (valid ? ro_j + head_off : 0), valid);
    }
  }

  // Paged KV, in two steps for a producer warpgroup (kThreads >= kTileKV loaders, one row each):
  // resolve_rows gives each row of the tile its element offset once (64-bit math per row, not per
  // 16-byte chunk; -1 past kv_end) into row_off [kTileKV] in shared memory, from a page id fetched
  // one tile earlier (RowPage), so no copy waits on a page-table load; after a barrier among the
  // loaders, load_resolved issues the copies from those offsets.
  struct RowPage {
    int32_t page = 0, in_page = -1;  // this thread's row of a tile; in_page -1: past kv_end
  };

  static AF_DEVICE RowPage fetch_row(const PagedKV& kv, int kv_end, int t0) {
    static_assert(kThreads >= kTileKV, "one row per loader");
    RowPage rp;
    const int pos = t0 + int(threadIdx.x % kThreads);
    if (threadIdx.x % kThreads < kTileKV && pos < kv_end) {
      const int slot = kv.page_of(pos);
      rp.page = kv.page_id(slot);
      rp.in_page = pos - slot * kv.page_size;
    }
    return rp;
  }

  static AF_DEVICE void resolve_rows(const PagedKV& kv, const RowPage& rp, int64_t* row_off) {
    if (threadIdx.x % kThreads < kTileKV)
      row_off[threadIdx.x % kThreads] =
          rp.in_page < 0 ? -1 : int64_t(rp.page) * kv.stride_page + int64_t(rp.in_page) * kv.stride_token;
  }

  // mats: which matrices to copy (kBoth, or kKOnly / kVOnly where K and V have their own ring slots)
  static AF_DEVICE void load_resolved(const TKV* k_cache, const TKV* v_cache, const PagedKV& kv, int kv_head,
                                      const int64_t* row_off, char* sk, char* sv, int mats = kBoth) {
    const int ch = threadIdx.x % Base::kChunks, row0 = threadIdx.x / Base::kChunks;
    const int64_t head_off = kv.token_base + int64_t(kv_head) * kv.stride_head + ch * Base::kElems;
#pragma unroll
    for (int j = 0; j < Base::kRowsPerThread; ++j) {
      const int row = row0 + j * Base::kRowStep;
      const int64_t ro = row_off[row];
      const bool valid = ro >= 0;
      const int dst = sw128_offset(row, ch, kTileKV);
      if (mats & kKOnly) cp_async_16(sk + dst, k_cache + (valid ? ro + head_off : 0), valid);
      if (mats & kVOnly) cp_async_16(sv + dst, v_cache + (valid ? ro + head_off : 0), valid);
    }
  }

  // Ragged (unpaged) KV: the tile's rows are consecutive tokens, so one 64-bit offset per thread
  // steps by a constant, with no page-table load, division or branch (load() costs ~600
  // instructions per warp per tile; this ~60).
  static AF_DEVICE void load_contiguous(const TKV* k_cache, const TKV* v_cache, const PagedKV& kv, int kv_head,
                                        int kv_end, int t0, char* sk, char* sv, int mats = kBoth) {
    const int ch = threadIdx.x % Base::kChunks, row0 = threadIdx.x / Base::kChunks;
    const int64_t step = int64_t(Base::kRowStep) * kv.stride_token;
    int64_t off = kv.token_base + int64_t(kv_head) * kv.stride_head + ch * Base::kElems +
                  int64_t(t0 + row0) * kv.stride_token;
#pragma unroll
    for (int j = 0; j < Base::kRowsPerThread; ++j, off += step) {
      const bool valid = t0 + row0 + j * Base::kRowStep < kv_end;
      const int dst = sw128_offset(row0 + j * Base::kRowStep, ch, kTileKV);  // an immediate step when kRowStep % 8 == 0
      if (mats & kKOnly) cp_async_16(sk + dst, k_cache + (valid ? off : 0), valid);
      if (mats & kVOnly) cp_async_16(sv + dst, v_cache + (valid ? off : 0), valid);
    }
  }
};

// Ragged rows [t0, t0 + kTileKV) of one matrix of kCols 16-bit columns (any multiple of 64) into an sw128
// tile, rows past kv_end zero-filled; `head` points at the request's first token of this KV head.
// For widths whose rows do not map onto a warp's lanes (Sw128KVLoader needs 32 % (kCols / 8) == 0:
// 192-column K beside 128-column V); it serves an item's edge tile, TMA boxes the others.
template <class T, int kCols, int kTileKV, int kThreads>
AF_DEVICE void load_rows_sw128(const T* head, int64_t stride_token, int kv_end, int t0, char* tile) {
  static_assert(sizeof(T) == 2 && kCols % 64 == 0, "sw128 tiles hold 16-bit values in 64-column blocks");
  constexpr int kChunks = kCols / 8;  // 16-byte chunks a row
  for (int i = threadIdx.x % kThreads; i < kTileKV * kChunks; i += kThreads) {
    const int row = i / kChunks, ch = i % kChunks;
    const bool valid = t0 + row < kv_end;
    cp_async_16(tile + sw128_offset(row, ch, kTileKV), head + (valid ? int64_t(t0 + row) * stride_token + ch * 8 : 0),
                valid);
  }
}

}  // namespace attnforge
