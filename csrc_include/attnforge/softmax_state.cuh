// attnforge/softmax_state.cuh: the online-softmax state of one row and merges of states.
//
// Kernels work in the log2 domain (x = score * log2(e)) so every exponential is one ex2.
// Public LSE values (returned to Python, consumed by merge_states) are natural-log:
//   lse = (m + log2(d)) * ln(2), and an empty row has lse = -inf and output 0.
#pragma once
#include "attnforge/common.cuh"

namespace attnforge {

struct SoftmaxState {
  float m = kNegInf;  // running max, log2 domain
  float d = 0.f;      // sum of 2^(x - m)

  // Fold in a new block max; returns the factor previous accumulators must be scaled by.
  AF_DEVICE float rescale_to(float block_max) {
    float m_new = fmaxf(m, block_max);
    // m_new == -inf: nothing seen yet; keep the factor finite (0 * anything stays 0).
    float scale = (m_new == kNegInf) ? 1.f : ex2(m - m_new);
    d *= scale;
    m = m_new;
    return scale;
  }
  // As rescale_to, but the reference max moves only when block_max passes it by more than `slack`
  // (log2 units): weights 2^(x - m) then stay below 2^slack (exact enough for bf16 / fp16 P and fp32
  // sums), and most blocks return exactly 1, so callers skip rescaling their accumulators.
  AF_DEVICE float rescale_lazily(float block_max, float slack) {
    return rescale_to(block_max > m + slack ? block_max : m);  // m = -inf: any finite max moves it
  }
  // Weight of a logit (log2 domain) under the current max.
  AF_DEVICE float weight(float x) const { return m == kNegInf ? 0.f : ex2(x - m); }

  AF_DEVICE float inv_sum() const { return d > 0.f ? 1.f / d : 0.f; }
  AF_DEVICE float lse_natural() const { return d > 0.f ? (m + lg2(d)) * kLn2 : kNegInf; }
};

// Merge of states given by natural-log LSEs, in one pass: out = sum_i exp(s_i - lse) * v_i.
// kBatch states per round trip: their loads are issued together, so a row split into hundreds of
// chunks (one long request over every SM) waits for ~n/kBatch memory latencies, not 2n.
// lse_of(i) -> float; v_of(i, float (&v)[N]). An -inf state's v is never used (it may be garbage);
// all -inf: acc stays 0 and lse_natural() is -inf (never NaN).
// Every lane of the warp must call it with the same begin and end: a __syncwarp fences the loads in ptxas's
// schedule. kLoadsTogether: after all of a batch's loads, so the values' loads fly with the LSEs' (one round
// trip a batch, at ~90 registers for 8-10 states); else after the LSE loads alone, then the values' (two round
// trips; 64 registers). Left to itself ptxas once scheduled an LSE's scaling between the LSE loads, and every
// load after it waited out the first one's round trip.
constexpr int kMergeBatch = 8;  // states in flight per thread: 8 x 16-byte loads

template <int kBatch, bool kLoadsTogether, int N, class LseOf, class VOf>
AF_DEVICE void merge_lse_states(int begin, int end, LseOf lse_of, VOf v_of, SoftmaxState& st, float (&acc)[N]) {
  for (int b = begin; b < end; b += kBatch) {
    float x[kBatch], v[kBatch][N];
    // Every load first, unconditionally (a state past `end` re-reads the last one and is then given
    // -inf): guarded loads compiled to a branch per state with the lse's scaling inside it, so each
    // state's lse load waited out its round trip before the next was issued (8 a batch, not 1)
    auto state = [&](int k) { return b + k < end ? b + k : end - 1; };
#pragma unroll
    for (int k = 0; k < kBatch; ++k) x[k] = lse_of(state(k));
    if constexpr (!kLoadsTogether) __syncwarp();
#pragma unroll
    for (int k = 0; k < kBatch; ++k) v_of(state(k), v[k]);
    if constexpr (kLoadsTogether) __syncwarp();
#pragma unroll
    for (int k = 0; k < kBatch; ++k) x[k] = b + k < end ? x[k] * kLog2e : kNegInf;
    float block_max = kNegInf;
#pragma unroll
    for (int k = 0; k < kBatch; ++k) block_max = fmaxf(block_max, x[k]);
    const float scale = st.rescale_to(block_max);
#pragma unroll
    for (int i = 0; i < N; ++i) acc[i] *= scale;
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const float w = st.weight(x[k]);
      st.d += w;
#pragma unroll
      for (int i = 0; i < N; ++i) acc[i] = w > 0.f ? fmaf(w, v[k][i], acc[i]) : acc[i];
    }
  }
}

// blockDim.z lanes merged disjoint subsets of one row's states (threadIdx.x owning 4 of the row's
// kCols columns); lane 0 gathers them through `scratch` ([blockDim.z][kCols + 4] floats, shared) and
// returns true with the row's state in st and acc; the other lanes return false. One row per
// block (every thread reaches the barrier); a single lane returns at once.
template <int kCols>
AF_DEVICE bool combine_lanes(SoftmaxState& st, float (&acc)[4], float* scratch) {
  constexpr int kStride = kCols + 4;  // keeps every lane's float4s 16-byte aligned
  const int lanes = blockDim.z, d0 = 4 * threadIdx.x;
  if (lanes == 1) return true;
  float* mine = scratch + threadIdx.z * kStride;
  *reinterpret_cast<float4*>(mine + d0) = make_float4(acc[0], acc[1], acc[2], acc[3]);
  if (threadIdx.x == 0) {
    mine[kCols] = st.m;
    mine[kCols + 1] = st.d;
  }
  __syncthreads();
  if (threadIdx.z != 0) return false;
  float m = kNegInf;
  for (int z = 0; z < lanes; ++z) m = fmaxf(m, scratch[z * kStride + kCols]);
  float d = 0.f, a[4] = {0.f, 0.f, 0.f, 0.f};
  for (int z = 0; z < lanes; ++z) {
    const float* lane = scratch + z * kStride;
    const float w = lane[kCols] == kNegInf ? 0.f : ex2(lane[kCols] - m);  // an empty lane weighs nothing
    d += w * lane[kCols + 1];
    const float4 v = *reinterpret_cast<const float4*>(lane + d0);
    a[0] += w * v.x; a[1] += w * v.y; a[2] += w * v.z; a[3] += w * v.w;
  }
  st.m = m;
  st.d = d;
#pragma unroll
  for (int j = 0; j < 4; ++j) acc[j] = a[j];
  return true;
}

}  // namespace attnforge
