// Does compute-sanitizer racecheck order accesses across __syncthreads once a CTA also uses a named barrier
// among a subset of its warps, or mbarriers? A minimal model of the transposed MLA kernel's item loop (its
// producer warpgroup variant): warpgroup 0 stages values, every thread reads them, warpgroup 1 overwrites the
// buffer for the next item, with a __syncthreads between each step. The accesses are ordered by those barriers
// in every variant, so racecheck should report 0 hazards in each; any hazard it reports is the tool's. On an H100
// (eighty-sixth session) it reported 0 in variants 0, 1, 2, 5 and 7, and in 3 (1), 4 (2) and 6 (5) the write_output /
// read pairs across __syncthreads that it reports on the MLA producer kernel, and an mbarrier's init / arrive.
//   nvcc -arch=sm_90a -o /tmp/subset_barrier tools/racecheck_subset_barrier.cu
//   compute-sanitizer --tool racecheck /tmp/subset_barrier V    (V: 0 plain, 1 + subset bar.sync, 2 + mbarrier, 3 both,
//   4 + a bar.arrive / bar.sync hand-over over all 256 threads, as the producer kernel without early S^T has; 5-7: 4
//   with 1-3)
#include <cstdio>
#include <cstdlib>
#include <cstdint>

constexpr int kThreads = 256, kGroup = 128, kElems = 2048;

__device__ uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

__global__ void __launch_bounds__(kThreads) item_loop(float* out, int items, int variant) {
  __shared__ float buf[kElems];
  __shared__ __align__(8) uint64_t bar;
  const bool group0 = threadIdx.x < kGroup;
  float acc = 0.f;
  for (int it = 0; it < items; ++it) {
    if (threadIdx.x == 0 && (variant & 2))
      asm volatile("mbarrier.init.shared.b64 [%0], %1;" ::"r"(smem_u32(&bar)), "r"(kGroup) : "memory");
    __syncthreads();
    if (variant & 4) {  // the stage hand-over by named barrier 2: the producer arrives, the computing warpgroup waits
      if (group0) asm volatile("bar.sync 2, %0;" ::"n"(kThreads) : "memory");
      else asm volatile("bar.arrive 2, %0;" ::"n"(kThreads) : "memory");
    }
    if (group0) {  // write_output: the computing warpgroup stages its rows
      for (int i = threadIdx.x; i < kElems; i += kGroup) buf[i] = float(it * kElems + i);
      if (variant & 1) asm volatile("bar.sync 1, %0;" ::"n"(kGroup) : "memory");  // compute_sync
    } else if (variant & 2) {  // the producer's hand-over: arrive, then wait for the phase
      uint64_t state;
      asm volatile("mbarrier.arrive.shared.b64 %0, [%1];" : "=l"(state) : "r"(smem_u32(&bar)) : "memory");
      uint32_t done = 0;
      while (!done)
        asm volatile("{\n.reg .pred p;\nmbarrier.test_wait.shared.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}"
                     : "=r"(done) : "r"(smem_u32(&bar)), "l"(state) : "memory");
    }
    __syncthreads();
    for (int i = threadIdx.x; i < kElems; i += kThreads) acc += buf[i];  // store_staged_rows: every thread reads
    __syncthreads();
    if (!group0)  // the next item's copies into the same bytes
      for (int i = threadIdx.x - kGroup; i < kElems; i += kGroup) buf[i] = -1.f;
    __syncthreads();
  }
  out[blockIdx.x * kThreads + threadIdx.x] = acc;
}

int main(int argc, char** argv) {
  const int variant = argc > 1 ? atoi(argv[1]) : 0;
  float* out;
  cudaMalloc(&out, 4 * kThreads * sizeof(float));
  item_loop<<<4, kThreads>>>(out, 3, variant);
  const cudaError_t err = cudaDeviceSynchronize();
  printf("variant %d: %s\n", variant, cudaGetErrorString(err));
  return err == cudaSuccess ? 0 : 1;
}
