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
  // Weight of a logit (log2 domain) under the current max.
  AF_DEVICE float weight(float x) const { return m == kNegInf ? 0.f : ex2(x - m); }

  AF_DEVICE float lse_natural() const { return d > 0.f ? (m + lg2(d)) * kLn2 : kNegInf; }
};

// Merge weights for states given by natural-log LSEs: w_i = exp(s_i - M) / sum_j exp(s_j - M).
// All -inf: every weight 0 and the merged LSE -inf (never NaN).
struct LseMerger {
  float m = kNegInf;  // max of s_i * log2(e)
  float d = 0.f;
  AF_DEVICE void add_max(float s) { m = fmaxf(m, s * kLog2e); }
  AF_DEVICE float weight(float s) const { return m == kNegInf ? 0.f : ex2(s * kLog2e - m); }
  AF_DEVICE void add_weight(float w) { d += w; }
  AF_DEVICE float inv_sum() const { return d > 0.f ? 1.f / d : 0.f; }
  AF_DEVICE float lse_natural() const { return d > 0.f ? (m + lg2(d)) * kLn2 : kNegInf; }
};

}  // namespace attnforge
