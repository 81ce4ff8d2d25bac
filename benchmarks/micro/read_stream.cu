// The read roofline under the decode suites: how fast can any kernel on this GPU stream a buffer once, and
// what does a launch cost in a graph of back-to-back calls? (benchmarks/bench_roofline.py times it.)
// read_stream_kernel: every thread reads 16-byte chunks, kUnroll of them in flight, consecutive threads on
// consecutive chunks (a warp reads 512 contiguous bytes a load), and folds them into one word so that no
// load is dead code. read_bulk_kernel: one thread a CTA streams its share in blocks of chunk_bytes through
// a ring of `stages` shared-memory slots by bulk copies (the copy engine, as TMA), so that neither the
// register file nor the load-issue rate bounds the bytes in flight.
#include <cstdint>

struct ReadParams {
  const uint4* src;      // [n16] 16-byte chunks
  uint64_t n16;          // chunks to read (0: an empty launch, the fixed cost alone)
  uint32_t* sink;        // written only if the fold hits a value random data practically never gives
  uint32_t chunk_bytes;  // read_bulk_kernel: bytes a bulk copy (a multiple of 16 that divides n16 * 16)
  uint32_t stages;       // read_bulk_kernel: ring slots (1..kMaxStages); shared memory = stages * chunk_bytes
};

constexpr int kUnroll = 8;  // chunks in flight a thread: 8 x 16 B x 512 threads = 64 KB a CTA

__device__ __forceinline__ uint4 load_streaming(const uint4* p) {
  uint4 v;  // .nc: read-only for the kernel; L1::no_allocate: each byte is read once
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

extern "C" __global__ void __launch_bounds__(512) read_stream_kernel(ReadParams p) {
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  uint32_t fold = 0;
  for (; i + (kUnroll - 1) * stride < p.n16; i += kUnroll * stride) {
    uint4 v[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) v[k] = load_streaming(p.src + i + k * stride);
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) fold ^= v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
  }
  for (; i < p.n16; i += stride) {  // the last partial round
    const uint4 v = load_streaming(p.src + i);
    fold ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (fold == 0x9e3779b9u) p.sink[0] = fold;
}

constexpr int kMaxStages = 8;

__device__ __forceinline__ void bar_init(uint32_t bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void bar_wait(uint32_t bar, uint32_t parity) {
  asm volatile("{\n.reg .pred done;\nWAIT_%=:\nmbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
               "@!done bra WAIT_%=;\n}" ::"r"(bar), "r"(parity) : "memory");
}

// Announce the slot's bytes (the phase's one arrival) and copy them; the phase ends when they have landed.
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

extern "C" __global__ void __launch_bounds__(32) read_bulk_kernel(ReadParams p) {
  extern __shared__ __align__(128) unsigned char ring[];  // [stages][chunk_bytes]
  __shared__ __align__(8) uint64_t bars[kMaxStages];
  if (threadIdx.x != 0) return;
  const uint64_t blocks = p.n16 * 16 / p.chunk_bytes;  // block b of this CTA: blockIdx.x + b * gridDim.x
  const uint32_t ring_addr = static_cast<uint32_t>(__cvta_generic_to_shared(ring));
  const uint32_t bar0 = static_cast<uint32_t>(__cvta_generic_to_shared(bars));
  for (uint32_t s = 0; s < p.stages; ++s) bar_init(bar0 + 8 * s);
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");  // the inits, before the copy engine's use
  const char* src = reinterpret_cast<const char*>(p.src);
  uint64_t issued = 0, waited = 0;  // this CTA's blocks
  auto block_at = [&](uint64_t k) { return blockIdx.x + k * gridDim.x; };
  for (; issued < p.stages && block_at(issued) < blocks; ++issued) {
    const uint32_t slot = static_cast<uint32_t>(issued);
    bulk_copy(ring_addr + slot * p.chunk_bytes, src + block_at(issued) * p.chunk_bytes, p.chunk_bytes, bar0 + 8 * slot);
  }
  uint32_t fold = 0;
  for (; waited < issued; ++waited) {
    const uint32_t slot = static_cast<uint32_t>(waited % p.stages);
    bar_wait(bar0 + 8 * slot, static_cast<uint32_t>(waited / p.stages) & 1);
    fold ^= *reinterpret_cast<const uint32_t*>(ring + slot * p.chunk_bytes);  // one word: the bytes are here
    if (block_at(issued) < blocks) {  // the slot is free again: its next block
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the read above, before the copy engine's write
      bulk_copy(ring_addr + slot * p.chunk_bytes, src + block_at(issued) * p.chunk_bytes, p.chunk_bytes, bar0 + 8 * slot);
      ++issued;
    }
  }
  if (fold == 0x9e3779b9u) p.sink[0] = fold;
}
