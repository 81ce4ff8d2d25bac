// attnforge/work_stream.cuh: a CTA's share of the split-KV work stream (see attnforge/scheduler.py).
//
// Items (request, kv_head) lie end to end, request-major, each `stride` stream positions long: its cost
// (tokens + kFixedCost), or more where the planner padded equal items to whole spans; the kernel reads
// it back with item_stride(). An item's tokens take the positions after its first kFixedCost.
// CTA c owns stream positions [c*span, (c+1)*span): the tokens there, and the empty items
// that start there. Chunks of split items write partial slot 2*c + (chunk starts its item ? 1 : 0).
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
};

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
  int32_t num_kv_heads, lo, hi, span, batch;
  int32_t r, h;  // current item

  AF_DEVICE WorkStream(const int32_t* prefix_, const int32_t* begin_, const int32_t* end_, int32_t heads,
                       const StreamMeta& meta, int cta)
      : prefix(prefix_), kv_begin(begin_), kv_end(end_), num_kv_heads(heads), span(meta.span), batch(meta.batch) {
    lo = cta * meta.span;
    hi = min(lo + meta.span, meta.total);
    r = h = 0;
    if (lo >= hi || batch == 0) {  // no work for this CTA (the grid is sized for the worst case)
      r = batch;
      return;
    }
    // request holding stream position lo: the last r with prefix[r] <= lo (binary search)
    int a = 0, b = batch;  // invariant: prefix[a] <= lo < prefix[b] (when lo < total)
    while (b - a > 1) {
      const int mid = (a + b) / 2;
      if (__ldg(prefix + mid) <= lo) a = mid; else b = mid;
    }
    r = a;
    h = min((lo - __ldg(prefix + r)) / stride(r), num_kv_heads - 1);
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
      const bool split = (t_lo / span) != ((t_hi - 1) / span);
      c = {req, head, base + (a - t_lo), base + (b - t_lo),
           split ? 2 * (lo / span) + (a == t_lo ? 1 : 0) : -1, len};
      return true;
    }
    return false;
  }
};

}  // namespace attnforge
