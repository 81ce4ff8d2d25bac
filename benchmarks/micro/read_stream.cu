// The read roofline under the decode suites: how fast can any kernel on this GPU stream a buffer once, and
// what does a launch cost in a graph of back-to-back calls? (benchmarks/bench_roofline.py times it.)
// Every thread reads 16-byte chunks, kUnroll of them in flight, consecutive threads on consecutive chunks (a
// warp reads 512 contiguous bytes a load), and folds them into one word so that no load is dead code.
#include <cstdint>

struct ReadParams {
  const uint4* src;    // [n16] 16-byte chunks
  uint64_t n16;        // chunks to read (0: an empty launch, the fixed cost alone)
  uint32_t* sink;      // written only if the fold hits a value random data practically never gives
  uint32_t pad;
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
