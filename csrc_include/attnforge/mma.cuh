// attnforge/mma.cuh: warp-level tensor-core fragments (mma.sync m16n8k16, ldmatrix, movmatrix).
//
// Fragment layouts (g = lane / 4, c = lane % 4), f32 accumulators of one m16n8 tile:
//   acc[0], acc[1] -> (row g,     cols 2c, 2c+1)     acc[2], acc[3] -> (row g + 8, cols 2c, 2c+1)
// A (m16 x k16, row-major) regs: a0 (g, 2c..), a1 (g+8, 2c..), a2 (g, 2c+8..), a3 (g+8, 2c+8..)
// B (k16 x n8, "col"):         b0 (k 2c.., n g), b1 (k 2c+8.., n g)
#pragma once
#include "attnforge/common.cuh"

namespace attnforge {

AF_DEVICE void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
AF_DEVICE void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
// Transpose one 8x8 b16 matrix held one 32-bit pair per lane (accumulator -> B operand).
AF_DEVICE uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

template <class T> AF_DEVICE void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <>
AF_DEVICE void mma_16816<bf16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
               "{%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
AF_DEVICE void mma_16816<fp16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
               "{%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// fp8 e4m3 fragments widened in registers (ldmatrix treats fp8 rows as b16 pairs; T: bf16 / fp16).
// Four bytes (b0, b1, b2, b3) of one row (a non-trans ldmatrix: 4 consecutive fp8 columns) as
// the pairs (b0, b1) and (b2, b3).
template <class T>
AF_DEVICE void widen_fp8x4(uint32_t w, uint32_t& lo, uint32_t& hi) {
  lo = fp8x2_to<T, 0>(w);
  hi = fp8x2_to<T, 1>(w);
}
// Four bytes of an ldmatrix.trans over byte pairs -- (row r: cols 2i, 2i+1), (row r+1: cols 2i,
// 2i+1) -- regrouped per column: (b0, b2) = column 2i of rows r, r+1 and (b1, b3) = column 2i+1.
template <class T>
AF_DEVICE void widen_fp8x4_trans(uint32_t w, uint32_t& even, uint32_t& odd) {
  const uint32_t cols = __byte_perm(w, 0, 0x3120);  // bytes (b0, b2, b1, b3)
  even = fp8x2_to<T, 0>(cols);
  odd = fp8x2_to<T, 1>(cols);
}

}  // namespace attnforge
