"""The decode kernels' fp8 paths widen K and V in registers (templates/batch_decode.cu.jinja: the transposed
pipeline's compute_tile_fp8, and the normal pipeline's compute_tile with kRegWiden, where K and V are the MMAs'
B operands): a host model of their fragment bookkeeping. ldmatrix (PTX ISA, m8n8.b16): matrix i
takes its row addresses from lanes 8i..8i+7; without .trans lane t receives the b16 pair at (row
t / 4, b16 columns 2(t % 4), +1), with .trans the b16 elements (rows 2(t % 4), +1; column t / 4).
mma.m16n8k16: A regs a0 (g, k 2c..), a1 (g+8, 2c..), a2 (g, 2c+8..), a3 (g+8, 2c+8..); B regs b0
(k 2c.., n g), b1 (k 2c+8.., n g). The model checks that the permuted Q staging makes S^T exact and
that the V fragments' rows are the dims publish() writes them to."""
import numpy as np

LANES = np.arange(32)
G, C = LANES // 4, LANES % 4


def ldmatrix_x4(rows_bytes, lane_rows, lane_chunks, trans=False):
    """rows_bytes[row] is a row of 16-byte chunks (uint8); returns r[4][lane] as 4-byte tuples."""
    out = []
    for i in range(4):
        src = [rows_bytes[lane_rows[8 * i + k]][16 * lane_chunks[8 * i + k]:16 * lane_chunks[8 * i + k] + 16]
               for k in range(8)]  # the 8 rows of matrix i, 16 bytes = 8 b16 columns each
        regs = []
        for t in range(32):
            g, c = t // 4, t % 4
            if not trans:
                regs.append(tuple(src[g][4 * c:4 * c + 4]))
            else:  # (row 2c, col g) then (row 2c + 1, col g), each a b16 = 2 bytes
                regs.append(tuple(src[2 * c][2 * g:2 * g + 2]) + tuple(src[2 * c + 1][2 * g:2 * g + 2]))
        out.append(regs)
    return out


def widen(w):  # widen_fp8x4: (b0, b1), (b2, b3)
    return (w[0], w[1]), (w[2], w[3])


def widen_trans(w):  # widen_fp8x4_trans: __byte_perm(w, 0, 0x3120) -> (b0, b2), (b1, b3)
    perm = [w[0], w[2], w[1], w[3]]  # result byte i = source byte (0x3120 >> 4i) & 7
    assert perm == [w[(0x3120 >> (4 * i)) & 0xF] for i in range(4)]
    return (perm[0], perm[1]), (perm[2], perm[3])


def a_matrix(frags):
    """Logical A [16 x 16] from each lane's (a0, a1, a2, a3) pairs."""
    a = np.zeros((16, 16), dtype=np.int64)
    for t in range(32):
        g, c = t // 4, t % 4
        a0, a1, a2, a3 = frags[t]
        for j in range(2):
            a[g, 2 * c + j], a[g + 8, 2 * c + j] = a0[j], a1[j]
            a[g, 2 * c + 8 + j], a[g + 8, 2 * c + 8 + j] = a2[j], a3[j]
    return a


def test_k_fragments_with_permuted_q_give_exact_scores():
    rng = np.random.default_rng(0)
    k = rng.integers(1, 200, size=(16, 32), dtype=np.int64)  # 16 tokens x 32 dims (two k16 steps), fp8 values
    q = rng.integers(-50, 50, size=(8, 32), dtype=np.int64)  # 8 heads
    my_row = (LANES % 8) + ((LANES // 8) % 2) * 8
    r = ldmatrix_x4(list(k), my_row, LANES // 16)
    # Q staged per 16 dims as (0,1, 4,5, 8,9, 12,13 | 2,3, 6,7, 10,11, 14,15), from the b16 pair words
    order = [0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15]
    qs = np.concatenate([q[:, 16 * b + np.array(order)] for b in range(2)], axis=1)
    words = [(2 * i, 2 * i + 1) for i in range(8)]  # the staging kernel's view: chunk 0 = words 0, 2, 4, 6
    assert [d for w in (words[0], words[2], words[4], words[6], words[1], words[3], words[5], words[7])
            for d in w] == order
    s = np.zeros((16, 8), dtype=np.int64)
    for half in range(2):
        frags = []
        for t in range(32):
            lo0, hi0 = widen(r[2 * half][t])
            lo1, hi1 = widen(r[2 * half + 1][t])
            frags.append((lo0, lo1, hi0, hi1))  # a0 = lo(r0), a1 = lo(r1), a2 = hi(r0), a3 = hi(r1)
        a = a_matrix(frags)
        b = qs[:, 16 * half:16 * half + 16].T  # B[k][n] = staged Q[n][k] (the unchanged Q loads)
        s += a @ b
    assert np.array_equal(s, k @ q.T)


def test_v_fragments_rows_are_the_dims_publish_writes():
    rng = np.random.default_rng(1)
    v = rng.integers(1, 200, size=(16, 32), dtype=np.int64)  # 16 tokens x 32 dims (two m16 tiles)
    p = rng.integers(0, 9, size=(16, 8), dtype=np.int64)    # P^T [tokens x heads]
    my_row = (LANES % 8) + ((LANES // 8) % 2) * 8
    r = ldmatrix_x4(list(v), my_row, LANES // 16, trans=True)
    o_t = np.zeros((32, 8), dtype=np.int64)
    for half in range(2):  # m-tile j = half (dims 16j ..)
        frags = []
        for t in range(32):
            e0, o0 = widen_trans(r[2 * half][t])      # tokens 0-7
            e1, o1 = widen_trans(r[2 * half + 1][t])  # tokens 8-15
            frags.append((e0, o0, e1, o1))            # a0 = even(r0), a1 = odd(r0), a2 = even(r1), a3 = odd(r1)
        acc = a_matrix(frags) @ p  # O^T m-tile: rows g, g + 8
        for g in range(8):  # publish(): rows g, g + 8 -> dims 16j + 2g, 16j + 2g + 1
            o_t[16 * half + 2 * g] = acc[g]
            o_t[16 * half + 2 * g + 1] = acc[g + 8]
    assert np.array_equal(o_t, v.T @ p)


def b_matrix(frags):
    """Logical B [16 x 8] (k x n) from each lane's (b0, b1) pairs."""
    b = np.zeros((16, 8), dtype=np.int64)
    for t in range(32):
        g, c = t // 4, t % 4
        b0, b1 = frags[t]
        for j in range(2):
            b[2 * c + j, g], b[2 * c + 8 + j, g] = b0[j], b1[j]
    return b


def staged_q(q):
    """Q's rows staged per 16 dims as (0,1, 4,5, 8,9, 12,13 | 2,3, 6,7, 10,11, 14,15) (QStage, kRegWiden)."""
    order = np.array([0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15])
    return np.concatenate([q[:, 16 * b + order] for b in range(q.shape[1] // 16)], axis=1)


def test_normal_pipeline_k_fragments_as_b_with_permuted_q_give_exact_scores():
    """Normal pipeline, S = Q K^T: lanes 0-7 / 8-15 address tokens 0-7 / 8-15 of a 16-dim chunk, lanes 16-31 the
    next chunk; widen(r) of tokens 0-7 is n-tile 0's (b0, b1), of tokens 8-15 n-tile 1's."""
    rng = np.random.default_rng(2)
    k = rng.integers(1, 200, size=(16, 32), dtype=np.int64)  # 16 tokens x 32 dims (two k16 steps)
    q = rng.integers(-50, 50, size=(16, 32), dtype=np.int64)  # one m16 tile of query rows
    my_row = (LANES % 8) + ((LANES // 8) % 2) * 8
    r = ldmatrix_x4(list(k), my_row, LANES // 16)
    qs = staged_q(q)
    s = np.zeros((16, 16), dtype=np.int64)  # rows x tokens: n-tiles 0 (tokens 0-7) and 1 (8-15)
    for half in range(2):  # k step kk + half
        a = qs[:, 16 * half:16 * half + 16]  # A = staged Q (the unchanged ldmatrix of Q's A fragments)
        for nt in range(2):
            s[:, 8 * nt:8 * nt + 8] += a @ b_matrix([widen(r[2 * half + nt][t]) for t in range(32)])
    assert np.array_equal(s, q @ k.T)


def test_normal_pipeline_v_fragments_as_b_split_even_and_odd_dims_and_publish_restores_them():
    """Normal pipeline, O += P V: widen_trans gives each lane dims 2g and 2g + 1 of tokens 2c, 2c + 1, so n-tile 2J
    holds chunk J's even dims and 2J + 1 its odd ones; publish() writes lane c's (o[2J][e], o[2J+1][e],
    o[2J][e+1], o[2J+1][e+1]) to dims 16J + 4c .. 16J + 4c + 3."""
    rng = np.random.default_rng(3)
    v = rng.integers(1, 200, size=(16, 32), dtype=np.int64)  # 16 tokens x 32 dims (chunks J = 0, 1)
    p = rng.integers(0, 9, size=(16, 16), dtype=np.int64)    # P [rows x tokens]
    my_row = (LANES % 8) + ((LANES // 8) % 2) * 8
    r = ldmatrix_x4(list(v), my_row, LANES // 16, trans=True)
    o_tiles = {}
    for half in range(2):  # chunk J = half
        even = [(widen_trans(r[2 * half][t])[0], widen_trans(r[2 * half + 1][t])[0]) for t in range(32)]
        odd = [(widen_trans(r[2 * half][t])[1], widen_trans(r[2 * half + 1][t])[1]) for t in range(32)]
        o_tiles[2 * half], o_tiles[2 * half + 1] = p @ b_matrix(even), p @ b_matrix(odd)  # [16 rows x 8]
    out = np.zeros((16, 32), dtype=np.int64)
    for t in range(32):  # publish(): C fragment (row g, cols 2c, 2c + 1) of each n-tile, rows g and g + 8
        g, c = t // 4, t % 4
        for row in (g, g + 8):
            for j in range(2):
                out[row, 16 * j + 4 * c:16 * j + 4 * c + 4] = [
                    o_tiles[2 * j][row, 2 * c], o_tiles[2 * j + 1][row, 2 * c],
                    o_tiles[2 * j][row, 2 * c + 1], o_tiles[2 * j + 1][row, 2 * c + 1]]
    assert np.array_equal(out, p @ v)
