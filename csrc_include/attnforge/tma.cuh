// attnforge/tma.cuh: tensor-memory-accelerator copies (sm_90). A tensor map, encoded on the host
// (attnforge/jit/tma.py) and passed by value in a __grid_constant__ parameter struct, describes a
// strided global tensor; one thread copies a box of it into shared memory, swizzled as the map says,
// and the copy engine adds the landed bytes to an mbarrier's transaction count.
//
// Protocol per barrier phase: one thread announces the phase's bytes (mbar_expect_tx) before any
// copy of that phase is issued; the phase completes once its arrivals are in and every byte landed.
#pragma once
#include "attnforge/common.cuh"

namespace attnforge {

// The driver's CUtensorMap: 128 opaque bytes, read by the copy engine from a 64-byte aligned address.
struct alignas(64) TensorMap {
  uint64_t opaque[16];
};

// Add `bytes` to the transaction count the current phase of `bar` waits for (no arrival).
AF_DEVICE void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// Box at coordinates (c0 innermost .. c3) of a 4-D map -> shared memory at `smem` (1024-byte
// aligned for a 128-byte swizzle); completes on `bar`.
AF_DEVICE void tma_load_4d(uint32_t smem, const TensorMap* map, int c0, int c1, int c2, int c3, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
      ::"r"(smem), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}

// Bring a map into the copy engine's descriptor cache ahead of its first use.
AF_DEVICE void tma_prefetch_map(const TensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

}  // namespace attnforge
