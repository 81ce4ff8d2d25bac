// attnforge/work_stream.cuh: a CTA's share of the split-KV work stream (see attnforge/scheduler.py).
//
// Items (request, kv_head) lie end to end, request-major, each `stride` stream positions long: its cost
// (tokens + kFixedCost), or more where the planner padded equal items to whole spans; the kernel reads
// it back with item_stride(). An item's tokens take the positions after its first kFixedCost.
// CTA c owns stream positions [cut(c), cut(c + 1)): the tokens there, and the empty items that start
// there. cut(k) is k*span, or with meta.snap > 0 the start or end of the item that position falls in,
// when that is at most snap positions away (span_cut): a short item is not split into a sliver.
// Chunks of split items write partial slot 2*c + (chunk starts its item ? 1 : 0).
#pragma once
#include "attnforge/common.cuh"

namespace attnforge {

// Stream positions of each of request r's `items` items: (prefix[r+1] - prefix[r]) / items. WorkStream
// walks by it; the merges find an item's chunks with it (they must cut exactly as the walk did).
AF_DEVICE int32_t item_stride(const int32_t* prefix, int r, int items) {
  return (__ldg(prefix + r + 1) - __ldg(prefix + r)) / items;
}

struct StreamMeta {  // device-resident, rewritten by every plan() (CUDA-graph safe)
  int32_t batch, span, total;
  int32_t snap;  // 0, or kFixedCost <= snap < span / 2 (scheduler.plan_stream checks): see span_cut
  int32_t any_split;  // 0: the plan cuts no item (MLA's merge, launched in graphs for every plan, exits)
};

// The request holding stream position x (the last r with prefix[r] <= x; 0 <= x < total), for two
// positions at once: the two searches' loads overlap.
AF_DEVICE int2 requests_at(const int32_t* prefix, int batch, int32_t x, int32_t y) {
  int ax = 0, bx = batch, ay = 0, by = batch;  // invariant: prefix[a] <= x < prefix[b]
  while (bx - ax > 1 || by - ay > 1) {
    const int mx = (ax + bx) / 2, my = (ay + by) / 2;
    const int32_t px = __ldg(prefix + mx), py = __ldg(prefix + my);
    if (bx - ax > 1) { if (px <= x) ax = mx; else bx = mx; }
    if (by - ay > 1) { if (py <= y) ay = my; else by = my; }
  }
  return make_int2(ax, ay);
}

// Where span boundary b = k*span (0 < b < total, inside request r) cuts: b, or the start or end of the
// item it falls in when that is at most `snap` away (the start first; snap < span / 2 keeps the cuts
// increasing). scheduler.span_cuts is the same rule on the host.
AF_DEVICE int32_t span_cut(const int32_t* prefix, int r, int items, int32_t snap, int32_t b) {
  if (snap == 0) return b;
  const int32_t stride = item_stride(prefix, r, items), p0 = __ldg(prefix + r);
  const int32_t s = p0 + min((b - p0) / stride, items - 1) * stride, e = s + stride;
  return b - s <= snap ? s : (e - b <= snap ? e : b);
}

// The CTAs [first, last] holding the tokens [t_lo, t_lo + n) of the item at stream position s (n > 0), as
// WorkStream cuts them; first == last: the item is whole. Only cuts strictly inside the tokens split
// them, and a boundary within snap of the item's start or end moved there (span_cut).
AF_DEVICE int2 item_ctas(const StreamMeta& m, int32_t s, int32_t stride, int32_t t_lo, int32_t n) {
  int32_t lo = t_lo, hi = t_lo + n;
  if (m.snap > 0) {
    lo = max(lo, s + m.snap);
    hi = min(hi, s + stride - m.snap);
  }
  const int32_t k_lo = lo / m.span + 1, k_hi = hi > lo ? (hi - 1) / m.span : 0;  // boundaries k*span in (lo, hi)
  return k_lo > k_hi ? make_int2(0, 0) : make_int2(k_lo - 1, k_hi);
}

struct Chunk {
  int32_t request, kv_head, kv_begin, kv_end;  // token range within the request
  int32_t partial_slot;                        // < 0: the item is whole, write the output directly
  int32_t kv_len;                              // the request's full KV length (for hooks)
};

template <int kFixedCost>
struct WorkStream {
  const int32_t* prefix;    // [batch + 1] stream start of each request (and the end of the last)
  const int32_t* kv_begin;  // [batch]
  const int32_t* kv_end;    // [batch]
  int32_t num_kv_heads, lo, hi, batch, cta;
  int32_t r, h;  // current item

  AF_DEVICE WorkStream(const int32_t* prefix_, const int32_t* begin_, const int32_t* end_, int32_t heads,
                       const StreamMeta& meta, int cta_)
      : prefix(prefix_), kv_begin(begin_), kv_end(end_), num_kv_heads(heads), batch(meta.batch), cta(cta_) {
    const int32_t b0 = cta * meta.span, b1 = b0 + meta.span;  // this CTA's span boundaries before snapping
    r = h = 0;
    if (b0 >= meta.total || batch == 0) {  // no work for this CTA (the grid is sized for the worst case)
      r = batch;
      return;
    }
    const int2 req = requests_at(prefix, batch, b0, min(b1, meta.total - 1));
    lo = cta == 0 ? 0 : span_cut(prefix, req.x, heads, meta.snap, b0);
    hi = b1 >= meta.total ? meta.total : span_cut(prefix, req.y, heads, meta.snap, b1);
    // the walk starts at the item holding b0: a cut moved back to its start gives this CTA that item,
    // one moved to its end leaves it no token there
    r = req.x;
    h = min((b0 - __ldg(prefix + r)) / stride(r), num_kv_heads - 1);
  }

  AF_DEVICE int32_t tokens(int req) const { return __ldg(kv_end + req) - __ldg(kv_begin + req); }
  AF_DEVICE int32_t stride(int req) const { return item_stride(prefix, req, num_kv_heads); }

  // The next chunk this CTA owns; false when the span is exhausted.
  AF_DEVICE bool next(Chunk& c) {
    while (lo < hi && r < batch) {
      const int32_t n = tokens(r), start = __ldg(prefix + r) + h * stride(r);
      if (start >= hi) return false;
      const int req = r, head = h;
      if (++h == num_kv_heads) { h = 0; ++r; }
      const int32_t base = __ldg(kv_begin + req), len = __ldg(kv_end + req);
      if (n == 0) {
        if (start < lo) continue;  // an earlier CTA owns it
        c = {req, head, base, base, -1, len};
        return true;
      }
      const int32_t t_lo = start + kFixedCost, t_hi = t_lo + n;
      const int32_t a = max(lo, t_lo), b = min(hi, t_hi);
      if (a >= b) continue;  // no token of this item in our span
      const bool split = a != t_lo || b != t_hi;  // another CTA holds the rest of its tokens
      c = {req, head, base + (a - t_lo), base + (b - t_lo), split ? 2 * cta + (a == t_lo ? 1 : 0) : -1, len};
      return true;
    }
    return false;
  }
};

}  // namespace attnforge
