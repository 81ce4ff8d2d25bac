// attnforge/variant.cuh: the variant hook contract every kernel family calls.
//
// A variant is a struct with
//   static constexpr bool kHasLogitsTransform, kHasMask, kHasOutputTransform;  (skip work when false)
//   template <class P> float logits_transform(const P&, float score, const LogitsIndex&) const;
//   template <class P> bool  logits_mask(const P&, const LogitsIndex&) const;     (false: masked out)
//   template <class P> float output_transform(const P&, float o, const OutputIndex&) const;
//   static constexpr bool kHasSink; template <class P> float sink_logit(const P&, uint32_t qo_head) const;
//     (an attention sink: an extra logit, natural-log units, added to the softmax denominator only)
//   static constexpr bool kAffineKV; template <class P> float affine_kv_slope(const P&, const LogitsIndex&) const;
//     (logits_transform(s) is s + A + B * kv with A, B independent of kv: B for the row, so a kernel
//     may evaluate the transform once per row and tile and step by B; attnforge/mods/affine.py)
//   static constexpr bool kScaledCore; template <class P> float core_in_scale(const P&) const;
//     float core_out_scale(const P&) const; float logits_core(const P&, float x) const;
//     (logits_transform(s) is out * core(in * s), in and out free of positions, out > 0: a kernel may
//     fold in into sm_scale and out into log2 e, the transform's row max being out times the core's;
//     attnforge/mods/scaled.py)
// `score` is q.k * sm_scale (natural-log units, as FlexAttention's score_mod sees it); the kernel
// converts to the log2 domain after the hooks. Extra tensors and scalars a variant needs live in
// the kernel's Params struct (rendered from the same field list the host packs).
#pragma once
#include <concepts>
#include "attnforge/common.cuh"

namespace attnforge {

struct LogitsIndex {
  uint32_t batch;    // request index in the batch
  uint32_t qo;       // query row within its request, 0 .. qo_len-1
  uint32_t kv;       // key position within its request, 0 .. kv_len-1
  uint32_t qo_head;
  uint32_t kv_head;
  uint32_t qo_len;
  uint32_t kv_len;
  // Queries are aligned to the end of the keys (decode, chunked prefill): absolute position.
  AF_DEVICE int32_t qo_pos() const { return int32_t(kv_len) - int32_t(qo_len) + int32_t(qo); }
};

struct OutputIndex {
  uint32_t batch, qo, qo_head, dim;
};

template <class V, class P>
concept AttentionVariant = requires(const V& v, const P& p, float s, LogitsIndex li, OutputIndex oi) {
  { V::kHasLogitsTransform } -> std::convertible_to<bool>;
  { V::kHasMask } -> std::convertible_to<bool>;
  { V::kHasOutputTransform } -> std::convertible_to<bool>;
  { V::kHasSink } -> std::convertible_to<bool>;
  { v.sink_logit(p, 0u) } -> std::same_as<float>;
  { v.logits_transform(p, s, li) } -> std::same_as<float>;
  { v.logits_mask(p, li) } -> std::same_as<bool>;
  { v.output_transform(p, s, oi) } -> std::same_as<float>;
};

#define AF_CHECK_VARIANT(V, P)                                                                  \
  static_assert(::attnforge::AttentionVariant<V, P>,                                            \
                "attention variant " #V " does not satisfy the contract in attnforge/variant.cuh " \
                "(kHas* flags, logits_transform, logits_mask, output_transform)")

// Defaults for every hook; variants derive from it and override what they change.
struct IdentityVariant {
  static constexpr bool kHasLogitsTransform = false;
  static constexpr bool kHasMask = false;
  static constexpr bool kHasOutputTransform = false;
  static constexpr bool kHasSink = false;
  static constexpr bool kAffineKV = false;
  static constexpr bool kScaledCore = false;
  template <class P> AF_DEVICE float core_in_scale(const P&) const { return 1.f; }
  template <class P> AF_DEVICE float core_out_scale(const P&) const { return 1.f; }
  template <class P> AF_DEVICE float logits_core(const P&, float x) const { return x; }
  template <class P> AF_DEVICE float sink_logit(const P&, uint32_t) const { return kNegInf; }
  template <class P> AF_DEVICE float affine_kv_slope(const P&, const LogitsIndex&) const { return 0.f; }
  template <class P> AF_DEVICE float logits_transform(const P&, float s, const LogitsIndex&) const { return s; }
  template <class P> AF_DEVICE bool logits_mask(const P&, const LogitsIndex&) const { return true; }
  template <class P> AF_DEVICE float output_transform(const P&, float o, const OutputIndex&) const { return o; }
};

// Gemma-2 style soft-cap: cap * tanh(score / cap); the cap is a runtime scalar (no rebuild per value).
struct SoftCapVariant : IdentityVariant {  // the spec's logits_soft_cap (> 0, validated in spec.py)
  static constexpr bool kHasLogitsTransform = true;
  template <class P> AF_DEVICE float logits_transform(const P& p, float s, const LogitsIndex&) const {
    return p.logits_soft_cap * fast_tanh(s * p.inv_logits_soft_cap);
  }
  static constexpr bool kScaledCore = true;
  template <class P> AF_DEVICE float core_in_scale(const P& p) const { return p.inv_logits_soft_cap; }
  template <class P> AF_DEVICE float core_out_scale(const P& p) const { return p.logits_soft_cap; }
  template <class P> AF_DEVICE float logits_core(const P&, float x) const { return fast_tanh(x); }
};

// Causal and sliding-window masks layered on any variant. window_left is a runtime scalar.
template <class Base, bool kCausal, bool kWindow>
struct WithPositionMask : Base {
  static constexpr bool kHasMask = Base::kHasMask || kCausal || kWindow;
  static constexpr bool kHasOwnMask = Base::kHasMask;  // beyond position: tiles inside the causal band still need it
  static constexpr bool kCausalMask = kCausal, kWindowMask = kWindow;  // for kernels that test positions as ranges
  template <class P> AF_DEVICE bool logits_mask(const P& p, const LogitsIndex& i) const {
    bool keep = Base::logits_mask(p, i);
    if constexpr (kCausal) keep = keep && int32_t(i.kv) <= i.qo_pos();
    if constexpr (kWindow) keep = keep && int32_t(i.kv) >= i.qo_pos() - p.window_left;
    return keep;
  }
  // The position masks alone (Base's mask assumed true): for tiles the planner flagged CAUSAL.
  template <class P> AF_DEVICE bool position_mask(const P& p, const LogitsIndex& i) const {
    bool keep = true;
    if constexpr (kCausal) keep = int32_t(i.kv) <= i.qo_pos();
    if constexpr (kWindow) keep = keep && int32_t(i.kv) >= i.qo_pos() - p.window_left;
    return keep;
  }
};

// One element's mask given its tile's planner flags (attnforge.blockmask): a FULL tile keeps every
// pair; on a CAUSAL tile the variant's own mask equals kv <= qo_pos for every pair (e.g. a
// document mask on a document's diagonal), so positions are compared instead of calling the hook.
template <class V, class P>
AF_DEVICE bool tile_mask(const V& var, const P& p, const LogitsIndex& i, bool full_tile, bool causal_tile) {
  if (full_tile) return true;
  if (causal_tile) return int32_t(i.kv) <= i.qo_pos() && var.position_mask(p, i);
  return var.logits_mask(p, i);
}

// Fold a sink logit into a finished row: lse' = log(e^lse + e^sink), o' = o * e^(lse - lse').
template <class V, class P>
AF_DEVICE float apply_sink(const V& var, const P& p, uint32_t qo_head, float& lse) {
  if constexpr (V::kHasSink) {
    const float s = var.sink_logit(p, qo_head);
    const float m = fmaxf(lse, s);
    if (m == kNegInf) return 0.f;
    const float total = m + logf(expf(lse - m) + expf(s - m));
    const float scale = expf(lse - total);
    lse = total;
    return scale;
  }
  return 1.f;
}

}  // namespace attnforge
