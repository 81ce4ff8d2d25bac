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


def check_kmajor(desc, rows, tile, tile_rows, row0, col0):
    """Operand row r, element k of the k16 step -> element (row0 + r, col0 + k) of the stored tile."""
    for r in range(rows):
        for k in range(16):
            assert read_kmajor(desc, r, k) == stored(tile, row0 + r, col0 + k, tile_rows), (r, k)


def check_mnmajor(desc, cols, tile, tile_rows, row0, col0):
    """Operand K row k of the k16 step, column n -> element (row0 + k, col0 + n) of the stored tile."""
    for k in range(16):
        for n in range(cols):
            assert read_mnmajor(desc, k, n) == stored(tile, row0 + k, col0 + n, tile_rows), (k, n)


def test_mla_normal_scores_and_pv():
    q, kt, p = BASE, BASE + 64 * 576 * 2, BASE + 3 * 64 * 576 * 2  # Q [64][576], a K tile [64][576], P [64][64]
    for wg in range(2):
        for kk in range(576 // 16):  # S = Q . K[32wg ..]^T: A = Q (64 rows), B = 32 token rows, K-major
            check_kmajor(kmajor_desc(q, 64, kk), 64, q, 64, 0, 16 * kk)
            check_kmajor(kmajor_desc(kt + wg * 32 * 128, 64, kk), 32, kt, 64, 32 * wg, 16 * kk)
        for kb in range(4):  # O[:, 256wg ..] += P . V: A = P K-major, B = V dims 256wg.. MN-major (N = 256)
            check_kmajor(kmajor_desc(p, 64, kb), 64, p, 64, 0, 16 * kb)
            check_mnmajor(mnmajor_desc(kt + wg * 4 * 64 * 128, 64, kb), 256, kt, 64, 16 * kb, 256 * wg)


@pytest.mark.parametrize("rows", [8, 16, 32])
def test_mla_transposed_scores_and_pv(rows):
    kt, q, p = BASE, BASE + 2 * 64 * 576 * 2, BASE + 3 * 64 * 576 * 2  # K tile, Q [rows][576], P^T [rows][64]
    for kk in range(576 // 16):  # S^T = K . Q^T: A = the tile (64 tokens), B = Q (rows), both K-major
        check_kmajor(kmajor_desc(kt, 64, kk), 64, kt, 64, 0, 16 * kk)
        check_kmajor(kmajor_desc(q, rows, kk), rows, q, rows, 0, 16 * kk)
    for d in range(512 // 64):  # O^T tile d += V^T . P^T: A = V^T MN-major (the transpose-A bit), B = P^T K-major
        for kb in range(4):
            check_mnmajor(mnmajor_desc(kt + d * 64 * 128, 64, kb), 64, kt, 64, 16 * kb, 64 * d)
            check_kmajor(kmajor_desc(p, rows, kb), rows, p, rows, 0, 16 * kb)


@pytest.mark.parametrize("head_dim,tile_kv", [(128, 128), (64, 128), (256, 64)])
def test_prefill_scores_and_pv(head_dim, tile_kv):
    tile_q = 64 if head_dim == 256 else 128  # kernels/prefill.py: one consumer warpgroup at head_dim 256
    q, kt = BASE, BASE + tile_q * head_dim * 2
    vt = kt + tile_kv * head_dim * 2
    for wg in range(tile_q // 64):  # this warpgroup's 64 rows of the Q tile
        for kk in range(head_dim // 16):
            check_kmajor(kmajor_desc(q + wg * 64 * 128, tile_q, kk), 64, q, tile_q, 64 * wg, 16 * kk)
            check_kmajor(kmajor_desc(kt, tile_kv, kk), tile_kv, kt, tile_kv, 0, 16 * kk)
    for kb in range(tile_kv // 16):
        check_mnmajor(mnmajor_desc(vt, tile_kv, kb), head_dim, vt, tile_kv, 16 * kb, 0)


def test_the_model_catches_a_wrong_offset():
    kt = BASE + 64 * 576 * 2
    b = kmajor_desc(kt + 31 * 128, 64, 0)  # a K half-tile off by one row: not 1024-aligned, and wrong
    assert any(read_kmajor(b, n, k) != stored(kt, 32 + n, k, 64) for n in range(32) for k in range(16))
