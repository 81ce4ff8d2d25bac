// attnforge/common.cuh: element types, conversions, 16-byte vectors and fast math.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include <cstring>
#include <type_traits>

#define AF_DEVICE __device__ __forceinline__
#define AF_HOST_DEVICE __host__ __device__ __forceinline__  // pure layout math, host-tested too

namespace attnforge {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -__builtin_huge_valf();

using bf16 = __nv_bfloat16;
using fp16 = __half;
using fp8e4m3 = __nv_fp8_e4m3;

// A value every lane of the warp holds, broadcast from lane 0 so ptxas knows it is warp-uniform: what
// derives from it (wgmma descriptors, shared-memory addresses) can live in uniform registers instead of
// passing through R2UR at each use. Values loaded from memory (tile counts, work items) look divergent
// to ptxas even where every lane loaded the same word.
AF_DEVICE uint32_t warp_uniform(uint32_t x) { return __shfl_sync(0xffffffffu, x, 0); }
AF_DEVICE int warp_uniform(int x) { return __shfl_sync(0xffffffffu, x, 0); }

// 2^x through the SFU; 2^-inf == +0, which is what masked logits need.
AF_DEVICE float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
// A value's bits as another type of the same size, on the device and in host-tested code (a memcpy of
// a register compiles to a move).
template <class To, class From>
AF_HOST_DEVICE To bit_cast(const From& x) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast: the sizes differ");
  To y;
  std::memcpy(&y, &x, sizeof(To));
  return y;
}

// 2^x on the FMA pipe: 2^round(x) in the exponent bits, 2^f for f in [-0.5, 0.5] by a cubic with
// p(0) = 1 exactly (max relative error 1.0e-4, below half an ulp of the bf16 / fp16 P it feeds). For
// a softmax whose SFU is the bottleneck (tanh and ex2 per score): ~8 instructions, no SFU. Inputs
// below -127 (-inf included) clamp to -127, where f = 0 and the bits come out exactly +0.
AF_HOST_DEVICE float ex2_poly(float x) {
  x = fmaxf(x, -127.f);
  const float shifted = x + 12582912.f;  // 1.5 * 2^23: the low mantissa bits now hold n = round(x)
  const float f = x - (shifted - 12582912.f);
  const float p = fmaf(fmaf(fmaf(0.05500858277f, f, 0.24221037328f), f, 0.69328290224f), f, 1.f);
  return bit_cast<float>(bit_cast<uint32_t>(p) + (bit_cast<uint32_t>(shifted) << 23));  // == n << 23: the constant's bits shift out
}
// __byte_perm (one PRMT) on the device, its definition on the host (tests run these helpers there)
AF_HOST_DEVICE uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t sel) {
#ifdef __CUDA_ARCH__
  return __byte_perm(a, b, sel);
#else
  const uint64_t x = (uint64_t(b) << 32) | a;  // bytes 0-3 of a, then 4-7 of b
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= uint32_t((x >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i);
  return r;
#endif
}

// Four e4m3 values (byte i of x) as fp16 values divided by 256, exactly, by integer ops alone (7 for
// four values; no conversion unit): an e4m3 code's sign, exponent and mantissa bits placed under fp16's
// read as the value / 2^8 (the exponent biases differ by 8), subnormals as fp16 subnormals alike; the
// NaN codes read +-480 / 256. lo: values 0 and 1 (value 0 in the low half), hi: values 2 and 3.
AF_HOST_DEVICE void e4m3x4_to_f16x4_div256(uint32_t x, uint32_t& lo, uint32_t& hi) {
  const uint32_t high = ((x >> 1) & 0x3F3F3F3Fu) | (x & 0x80808080u);  // per value: sign, 6 bits
  const uint32_t low = (x << 7) & 0x80808080u;                          // the mantissa's last bit
  lo = byte_perm(low, high, 0x5140);  // bytes low0 high0 low1 high1
  hi = byte_perm(low, high, 0x7362);
}

AF_DEVICE float lg2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
AF_DEVICE float fast_tanh(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// n / d for 0 <= n < 2^31 and 1 <= d < 2^31 as a multiply-high, an add and a shift (Granlund and Montgomery's
// round-up method), with (mul, shift) from the host's attnforge.intdiv.divisor(d): a division by a value known
// only at run time is otherwise a ~20-instruction sequence through the SFU's reciprocal.
AF_DEVICE uint32_t fast_div(uint32_t n, uint32_t mul, uint32_t shift) { return (__umulhi(n, mul) + n) >> shift; }

template <class T> AF_DEVICE float to_float(T x);
template <> AF_DEVICE float to_float<float>(float x) { return x; }
template <> AF_DEVICE float to_float<bf16>(bf16 x) { return __bfloat162float(x); }
template <> AF_DEVICE float to_float<fp16>(fp16 x) { return __half2float(x); }
template <> AF_DEVICE float to_float<fp8e4m3>(fp8e4m3 x) { return float(x); }

// 16 bytes of T (4 floats, 8 bf16, 16 e4m3) -> floats; e4m3 converts a pair per cvt.
template <class T> AF_DEVICE void unpack16(const uint4& raw, float (&out)[16 / sizeof(T)]);
template <> AF_DEVICE void unpack16<float>(const uint4& raw, float (&out)[4]) {
  out[0] = __uint_as_float(raw.x); out[1] = __uint_as_float(raw.y);
  out[2] = __uint_as_float(raw.z); out[3] = __uint_as_float(raw.w);
}
template <> AF_DEVICE void unpack16<bf16>(const uint4& raw, float (&out)[8]) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {  // a bf16 is the top half of its float
    out[2 * i] = __uint_as_float(w[i] << 16);
    out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
template <> AF_DEVICE void unpack16<fp8e4m3>(const uint4& raw, float (&out)[16]);  // (below fp8x8_to)

template <class T> AF_DEVICE T from_float(float x);
template <> AF_DEVICE float from_float<float>(float x) { return x; }
template <> AF_DEVICE bf16 from_float<bf16>(float x) { return __float2bfloat16_rn(x); }
template <> AF_DEVICE fp16 from_float<fp16>(float x) { return __float2half_rn(x); }

// Two floats -> one packed 32-bit pair of 16-bit values (the mma operand format).
template <class T> AF_DEVICE uint32_t pack2(float lo, float hi);
template <> AF_DEVICE uint32_t pack2<bf16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <> AF_DEVICE uint32_t pack2<fp16>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// The e4m3 pair in half kHalf of a word (0: bits 0-15, low byte first) -> f16x2: one cvt.f16x2.e4m3x2 that
// reads the register's half itself (R.H1 in SASS), where converting a 16-bit value shifted out of the word
// costs a SHF or PRMT more a pair.
template <int kHalf> AF_DEVICE uint32_t e4m3x2_to_f16x2(uint32_t word) {
  static_assert(kHalf == 0 || kHalf == 1, "a word holds two pairs");
  uint32_t r;
  if constexpr (kHalf == 0) {
    asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e4m3x2 %0, lo;\n}" : "=r"(r) : "r"(word));
  } else {
    asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e4m3x2 %0, hi;\n}" : "=r"(r) : "r"(word));
  }
  return r;
}

// The e4m3 pair in half kHalf of a word -> a packed pair of T: the cvt above, plus a round trip through f32
// for bf16 (exact: every e4m3 value is representable in both).
template <class T, int kHalf> AF_DEVICE uint32_t fp8x2_to(uint32_t word) {
  const uint32_t h = e4m3x2_to_f16x2<kHalf>(word);
  if constexpr (std::is_same_v<T, fp16>) {
    return h;
  } else {
    static_assert(std::is_same_v<T, bf16>, "fp8 widens to fp16 or bf16");
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
    return pack2<bf16>(f.x, f.y);
  }
}

// Pairs 4 half .. 4 half + 3 of a 16-byte chunk of 16 e4m3 values (half: 0 or 1, a run-time value the callers'
// unrolled loops make constant) as 4 words of packed pairs of T.
template <class T> AF_DEVICE void fp8x8_to(const uint4& raw, int half, uint32_t (&o)[4]) {
  const uint32_t a = half ? raw.z : raw.x, b = half ? raw.w : raw.y;
  o[0] = fp8x2_to<T, 0>(a);
  o[1] = fp8x2_to<T, 1>(a);
  o[2] = fp8x2_to<T, 0>(b);
  o[3] = fp8x2_to<T, 1>(b);
}

template <> AF_DEVICE void unpack16<fp8e4m3>(const uint4& raw, float (&out)[16]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    uint32_t h[4];
    fp8x8_to<fp16>(raw, half, h);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h[i]));
      out[8 * half + 2 * i] = f.x;
      out[8 * half + 2 * i + 1] = f.y;
    }
  }
}

// A packed pair of From as a packed pair of To, each value times `scale` (a power of two: exact
// inside To's range). The identity when the types match and scale is 1.
template <class From, class To>
AF_DEVICE uint32_t convert_pair(uint32_t w, float scale) {
  if constexpr (std::is_same_v<From, To>) {
    if (scale == 1.f) return w;
  }
  const From* v = reinterpret_cast<const From*>(&w);
  return pack2<To>(to_float(v[0]) * scale, to_float(v[1]) * scale);
}

// A 16-byte vector of T: the unit of every global load and store.
template <class T>
struct Vec16 {
  static constexpr int kN = 16 / sizeof(T);
  uint4 raw;
  AF_DEVICE void load(const T* p) { raw = __ldg(reinterpret_cast<const uint4*>(p)); }
  AF_DEVICE void store(T* p) const { *reinterpret_cast<uint4*>(p) = raw; }
  AF_DEVICE T get(int i) const { return reinterpret_cast<const T*>(&raw)[i]; }
  AF_DEVICE void set(int i, T v) { reinterpret_cast<T*>(&raw)[i] = v; }
};

// Programmatic dependent launch (sm_90): a kernel launched with the PDL attribute (LoadedKernel.launch
// (pdl=True)) may start while the kernel before it in the stream still runs; it must call
// wait_for_prior_grid() before it reads anything that kernel wrote (the call returns once that grid
// has completed and its memory is visible; launched without the attribute, at once). A kernel calls
// let_dependents_launch() to allow its dependent's CTAs to be placed before it ends: placement only,
// never visibility, so where it stands is a matter of speed, not of correctness.
AF_DEVICE void wait_for_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
AF_DEVICE void let_dependents_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Loads of what the kernel before this one writes (queries, a selected page table, partial states),
// read after wait_for_prior_grid() by a kernel launched with PDL: through ld.global, never __ldg's
// ld.global.nc. .nc promises the data is read-only for the reading kernel's whole lifetime, which under
// PDL overlaps the writer's, and ptxas used that: it issued decode's query loads (LDG.E.128.CONSTANT)
// ahead of the wait (ACQBULK), so a decode chained on its predecessor's output read the poison there
// (H200, twenty-fifth session). tests/jit/test_pdl.py keeps __ldg out of these reads.
// A plain load, not asm: a volatile asm load with a memory clobber pinned its neighbours' order too and
// cost Quest's fp8 scoring 5-7% (twenty-fifth session); the wait's own clobber keeps this one after it.
AF_DEVICE uint4 load_after_wait(const void* src) { return *static_cast<const uint4*>(src); }

// A load with acquire semantics at GPU scope: what the writer released before its write is visible to
// this thread's later reads.
AF_DEVICE int load_acquire_gpu(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// A GPU-scope acquire-release fence (sm_70+): with a relaxed atomic, the release and acquire patterns of
// the PTX memory model; lighter than __threadfence(), which is sequentially consistent.
AF_DEVICE void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;\n" ::: "memory"); }

// Clocks for the kernels' debug traces (template variable `trace`): this SM's cycle counter, and the
// GPU-wide nanosecond timer (comparable across SMs).
AF_DEVICE unsigned long long sm_clock() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%clock64;" : "=l"(t));
  return t;
}
AF_DEVICE unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Stores under a predicate, with no branch: code between a wgmma's issue and its wait must not branch
// (a control-flow merge while wgmmas fly makes ptxas serialise them, C7514).
AF_DEVICE void store16_if(void* p, uint32_t a, uint32_t b, uint32_t c, uint32_t d, bool pred) {
  asm volatile("{\n.reg .pred q;\nsetp.ne.b32 q, %5, 0;\n@q st.global.v4.b32 [%0], {%1, %2, %3, %4};\n}\n"
               ::"l"(p), "r"(a), "r"(b), "r"(c), "r"(d), "r"(int(pred)) : "memory");
}
// (an address, not a pointer: a caller may form it from a null base it never stores through, and
// pointer arithmetic on null would let the compiler assume the base non-null)
AF_DEVICE void store_f32_if(uint64_t addr, float v, bool pred) {
  asm volatile("{\n.reg .pred q;\nsetp.ne.b32 q, %2, 0;\n@q st.global.f32 [%0], %1;\n}\n"
               ::"l"(addr), "f"(v), "r"(int(pred)) : "memory");
}

// 4 consecutive values of T from floats, as one vector store (16 bytes of f32, 8 of a 16-bit T) where
// p is aligned to it, else one store each: nvcc splits an assignment through float4* of a float4 built
// from scalars into four 4-byte stores (decode's epilogue, seventieth session), and 16-bit values stored
// one by one cost four store instructions a vector.
template <class T>
AF_DEVICE void store_floats(T* p, const float (&v)[4]) {
  constexpr uintptr_t kAlign = 4 * sizeof(T);
  if ((reinterpret_cast<uintptr_t>(p) & (kAlign - 1)) != 0) {
#pragma unroll
    for (int j = 0; j < 4; ++j) p[j] = from_float<T>(v[j]);
  } else if constexpr (sizeof(T) == 4) {
    asm volatile("st.global.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "f"(v[0]), "f"(v[1]), "f"(v[2]), "f"(v[3])
                 : "memory");
  } else {
    asm volatile("st.global.v2.b32 [%0], {%1, %2};\n" ::"l"(p), "r"(pack2<T>(v[0], v[1])), "r"(pack2<T>(v[2], v[3]))
                 : "memory");
  }
}

// 16 bytes of floats another kernel wrote (the MLA merge's partial states, Quest's P / N; both kernels
// launched with PDL) into registers, through load_after_wait.
AF_DEVICE void load_floats(const float* p, float (&v)[4]) {
  const uint4 t = load_after_wait(p);
  v[0] = __uint_as_float(t.x); v[1] = __uint_as_float(t.y); v[2] = __uint_as_float(t.z); v[3] = __uint_as_float(t.w);
}
// ... or 4 16-bit values (8 bytes), widened (MLA's 16-bit partial states, MLADecodeKernel.partial_16bit)
template <class T>
AF_DEVICE void load_floats(const T* p, float (&v)[4]) {
  static_assert(sizeof(T) == 2, "4 floats, or 4 bf16 / fp16 values");
  const uint2 t = *reinterpret_cast<const uint2*>(p);
  const T* e = reinterpret_cast<const T*>(&t);
#pragma unroll
  for (int j = 0; j < 4; ++j) v[j] = to_float<T>(e[j]);
}

}  // namespace attnforge
