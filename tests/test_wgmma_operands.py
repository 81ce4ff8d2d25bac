"""Every wgmma operand of the MLA and prefill kernels addresses the element the loaders stored.

A model of how the hardware reads a 128B-swizzled operand from a descriptor (PTX ISA, shared-memory
matrix layouts). The prefill kernel's GPU tests validated it for K-major A/B and MN-major B; the MLA
transposed pipeline's MN-major A (the transpose-A bit) assumes A reads MN-major as B does:
  K-major  [rows][K]: element (r, k) at start + (r // 8) * SBO + (r % 8) * 128 + 2k
  MN-major [K][MN]:   element (k, n) at start + (n // 64) * LBO + (k // 8) * SBO + (k % 8) * 128 + 2 (n % 64)
then bits 4-6 of the address are XORed with bits 7-9. The descriptor arguments below are the
kernels' (templates/mla_decode.cu.jinja, batch_prefill_wgmma.cu.jinja); the stores are sw128_offset,
checked against the same swizzle rule in tests/test_wgmma_layout.py.
"""
import pytest

BASE = 1024 * 40  # any 1024-aligned shared-memory address


def swz(addr):
    return addr ^ (((addr >> 7) & 7) << 4)


def sw128_offset(row, chunk, rows):  # attnforge/cp_async.cuh
    return (chunk >> 3) * rows * 128 + row * 128 + (((chunk & 7) ^ (row % 8)) << 4)


def stored(base, row, col, rows):  # where a [rows][W] sw128 tile keeps element (row, col)
    return base + sw128_offset(row, col // 8, rows) + (col % 8) * 2


def kmajor_desc(tile, rows, k):  # attnforge/wgmma.cuh: (start, lbo, sbo)
    return tile + (k // 4) * rows * 128 + (k % 4) * 32, 16, 1024


def mnmajor_desc(tile, rows, k):
    return tile + k * 16 * 128, rows * 128, 1024


def read_kmajor(desc, r, k):
    start, _, sbo = desc
    return swz(start + (r // 8) * sbo + (r % 8) * 128 + 2 * k)


def read_mnmajor(desc, k, n):
    start, lbo, sbo = desc
    return swz(start + (n // 64) * lbo + (k // 8) * sbo + (k % 8) * 128 + 2 * (n % 64))


def test_mla_normal_scores_and_pv():
    q, kt, p = BASE, BASE + 64 * 576 * 2, BASE + 3 * 64 * 576 * 2  # Q [64][576], a K tile [64][576], P [64][64]
    for wg in range(2):
        for kk in range(576 // 16):  # S = Q . K[32wg ..]^T: A = Q (64 rows), B = 32 token rows, K-major
            a, b = kmajor_desc(q, 64, kk), kmajor_desc(kt + wg * 32 * 128, 64, kk)
            for r in range(64):
                for k in range(16):
                    assert read_kmajor(a, r, k) == stored(q, r, 16 * kk + k, 64)
            for n in range(32):
                for k in range(16):
                    assert read_kmajor(b, n, k) == stored(kt, 32 * wg + n, 16 * kk + k, 64)
        for kb in range(4):  # O[:, 256wg ..] += P . V: A = P K-major, B = V dims 256wg.. MN-major (N = 256)
            a, b = kmajor_desc(p, 64, kb), mnmajor_desc(kt + wg * 4 * 64 * 128, 64, kb)
            for r in range(64):
                for k in range(16):
                    assert read_kmajor(a, r, k) == stored(p, r, 16 * kb + k, 64)
            for k in range(16):
                for n in range(256):
                    assert read_mnmajor(b, k, n) == stored(kt, 16 * kb + k, 256 * wg + n, 64)


@pytest.mark.parametrize("rows", [8, 16, 32])
def test_mla_transposed_scores_and_pv(rows):
    kt, q, p = BASE, BASE + 2 * 64 * 576 * 2, BASE + 3 * 64 * 576 * 2  # K tile, Q [rows][576], P^T [rows][64]
    for kk in range(576 // 16):  # S^T = K . Q^T: A = the tile (64 tokens), B = Q (rows), both K-major
        a, b = kmajor_desc(kt, 64, kk), kmajor_desc(q, rows, kk)
        for m in range(64):
            for k in range(16):
                assert read_kmajor(a, m, k) == stored(kt, m, 16 * kk + k, 64)
        for n in range(rows):
            for k in range(16):
                assert read_kmajor(b, n, k) == stored(q, n, 16 * kk + k, rows)
    for d in range(512 // 64):  # O^T tile d += V^T . P^T: A = V^T MN-major (the transpose-A bit), B = P^T K-major
        for kb in range(4):
            a, b = mnmajor_desc(kt + d * 64 * 128, 64, kb), kmajor_desc(p, rows, kb)
            for k in range(16):
                for m in range(64):
                    assert read_mnmajor(a, k, m) == stored(kt, 16 * kb + k, 64 * d + m, 64)
            for n in range(rows):
                for k in range(16):
                    assert read_kmajor(b, n, k) == stored(p, n, 16 * kb + k, rows)


@pytest.mark.parametrize("head_dim,tile_kv", [(128, 128), (64, 128), (256, 64)])
def test_prefill_scores_and_pv(head_dim, tile_kv):
    tile_q = 64 if head_dim == 256 else 128  # kernels/prefill.py: one consumer warpgroup at head_dim 256
    q, kt = BASE, BASE + tile_q * head_dim * 2
    vt = kt + tile_kv * head_dim * 2
    for wg in range(tile_q // 64):
        q_tile = q + wg * 64 * 128  # this warpgroup's 64 rows of the Q tile
        for kk in range(head_dim // 16):
            a, b = kmajor_desc(q_tile, tile_q, kk), kmajor_desc(kt, tile_kv, kk)
            for r in range(64):
                for k in range(16):
                    assert read_kmajor(a, r, k) == stored(q, 64 * wg + r, 16 * kk + k, tile_q)
            for n in range(tile_kv):
                for k in range(16):
                    assert read_kmajor(b, n, k) == stored(kt, n, 16 * kk + k, tile_kv)
    for kb in range(tile_kv // 16):
        b = mnmajor_desc(vt, tile_kv, kb)
        for k in range(16):
            for n in range(head_dim):
                assert read_mnmajor(b, k, n) == stored(vt, 16 * kb + k, n, tile_kv)


def test_the_model_catches_a_wrong_offset():
    kt = BASE + 64 * 576 * 2
    b = kmajor_desc(kt + 31 * 128, 64, 0)  # a K half-tile off by one row: not 1024-aligned, and wrong
    assert any(read_kmajor(b, n, k) != stored(kt, 32 + n, k, 64) for n in range(32) for k in range(16))
