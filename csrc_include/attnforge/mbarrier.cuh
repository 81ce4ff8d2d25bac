// attnforge/mbarrier.cuh: shared-memory arrive/wait barriers (sm_90) for producer/consumer rings,
// and named barriers for warpgroups that take turns.
//
// A barrier completes a phase when `count` arrivals have landed; waiters name the phase parity they
// wait for (phase k of a ring slot used for the k-th time: parity k & 1).
#pragma once
#include "attnforge/common.cuh"

namespace attnforge {

AF_DEVICE void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Release semantics: this thread's earlier writes are visible to a thread that sees the phase end.
AF_DEVICE void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
AF_DEVICE void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// An arrival that fires once every cp.async this thread issued so far has landed (counted among the
// barrier's expected arrivals: .noinc), so the thread itself never waits for its copies.
AF_DEVICE void cp_async_mbar_arrive_noinc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// Non-blocking: whether the phase of that parity has completed.
AF_DEVICE bool mbar_test(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\n"
      "mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}

// Named CTA barriers (ids 1..15; 0 is __syncthreads): `count` threads in all, some arriving
// without waiting. Two warpgroups taking turns at the tensor cores use one each.
AF_DEVICE void named_bar_sync(int id, int count) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory"); }
// A named barrier that also ANDs a predicate over its `count` threads: every one gets the same answer.
AF_DEVICE bool named_bar_sync_and(int id, int count, bool pred) {
  uint32_t all;
  asm volatile(
      "{\n.reg .pred p, q;\n"
      "setp.ne.u32 q, %1, 0;\n"
      "bar.red.and.pred p, %2, %3, q;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(all)
      : "r"(uint32_t(pred)), "r"(id), "r"(count)
      : "memory");
  return all != 0;
}
AF_DEVICE void named_bar_arrive(int id, int count) { asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory"); }
// bar.sync when `wait` (warp-uniform), as one predicated instruction: no branch in the code around it
// (a branch while a wgmma is in flight makes ptxas serialise them, C7514).
AF_DEVICE void named_bar_sync_if(bool wait, int id, int count) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %0, 0;\n@p bar.sync %1, %2;\n}\n" ::"r"(int(wait)), "r"(id), "r"(count)
               : "memory");
}

// Register budgets of warp-specialised kernels (all warps of a warpgroup execute these together).
template <int N> AF_DEVICE void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N)); }
template <int N> AF_DEVICE void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N)); }

}  // namespace attnforge
