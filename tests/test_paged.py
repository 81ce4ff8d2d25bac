import numpy as np
import pytest

from attnforge import paged


def test_csr_lengths():
    t = paged.from_csr([0, 2, 2, 5], [3, 1, 0, 2, 4], [5, 0, 1], page_size=16)
    assert t.kv_len.tolist() == [21, 0, 33] and t.max_page_index == 4


def test_block_table_matches_csr():
    table = np.array([[7, 3, 0], [1, 0, 0], [2, 5, 6]])
    t = paged.from_block_table([17, 0, 33], table, page_size=16)
    assert t.indptr.tolist() == [0, 2, 2, 5] and t.indices.tolist() == [7, 3, 2, 5, 6]
    assert t.kv_len.tolist() == [17, 0, 33]


@pytest.mark.parametrize("args, msg", [
    (([0, 2, 1], [0, 1], [1, 1]), "non-decreasing"),
    (([1, 2], [0], [1]), "starting at 0"),
    (([0, 2], [0, 1, 2], [1]), "kv_indptr\\[-1\\]=2 entries"),
    (([0, 1], [0], [17]), "\\[1, page_size=16\\]"),
    (([0, 1], [0], [0]), "\\[1, page_size=16\\]"),
    (([0, 1], [0], [-3]), "\\[1, page_size=16\\]"),
    (([0, 1], [-3], [1]), "page ids >= 0"),
    (([0, 1], [0], [1, 1]), "one per request"),
    (([0, 1], [0.5], [1]), "integer"),
    (([0, 2], [[0, 1]], [1]), "kv_indices: expected a 1-D array of page ids, got shape \\[1, 2\\]"),
])
def test_csr_errors(args, msg):
    with pytest.raises(ValueError, match=msg):
        paged.from_csr(*args, page_size=16)


@pytest.mark.parametrize("page_size", [16.0, 0, -4, True, None, "16"])
def test_page_size_must_be_an_int_of_at_least_one(page_size):
    # 16.0 passed `>= 1` and the folded length checks then blamed kv_last_page_len: the page size is named first
    for build in (lambda: paged.from_csr([0, 1], [0], [3], page_size=page_size),
                  lambda: paged.from_block_table([3], [[0]], page_size=page_size)):
        with pytest.raises(ValueError, match=r"page_size: expected an int >= 1 \(tokens per page\), got "):
            build()
    assert paged.from_csr([0, 1], [0], [3], page_size=np.int64(16)).kv_len.tolist() == [3]  # numpy ints are ints


def test_block_table_too_narrow():
    with pytest.raises(ValueError, match="Widen the block table"):
        paged.from_block_table([40], np.zeros((1, 2), dtype=np.int32), page_size=16)


def test_random_page_table_helper_builds_valid_tables():
    """The GPU graph-replay tests draw their tables with this helper: each must be a valid CSR table."""
    from helpers import random_page_table
    rng = np.random.default_rng(0)
    for _ in range(20):
        lengths, indptr, indices, last = random_page_table(rng, 6, 16, 4096, 3000, (5000, 9000))
        table = paged.from_csr(indptr, indices, last, 16)
        assert np.array_equal(table.kv_len, lengths) and len(set(indices.tolist())) == len(indices)
        assert lengths.max() >= 5000


def test_folded_checks_accept_and_reject_exactly_what_the_rules_say():
    """from_csr folds its per-request checks into one unsigned maximum; on random tables (negative page
    counts, empty requests with any last_page_len, lasts around [1, page_size]) it must accept exactly
    the valid ones and give the kv lengths of the plain definition."""
    rng = np.random.default_rng(7)
    for _ in range(400):
        batch, ps = int(rng.integers(1, 6)), int(rng.choice([1, 7, 16]))
        pages = rng.integers(-1 if rng.random() < 0.2 else 0, 4, batch)
        indptr = np.concatenate([[0], np.cumsum(pages)])
        last = rng.integers(-2, ps + 3, batch)
        valid = (pages >= 0).all() and all(1 <= l <= ps for p, l in zip(pages, last) if p > 0)
        if not valid or indptr[-1] < 0:
            with pytest.raises(ValueError, match="non-decreasing|page_size="):
                paged.from_csr(indptr, np.zeros(max(indptr[-1], 0), dtype=np.int32), last, page_size=ps)
            continue
        t = paged.from_csr(indptr, np.arange(indptr[-1], dtype=np.int32), last, page_size=ps)
        expect = [(p - 1) * ps + l if p > 0 else 0 for p, l in zip(pages, last)]
        assert t.kv_len.tolist() == expect


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.int64, np.uint16, np.uint32])
def test_page_id_bound_and_negative_ids_in_every_int_dtype(dtype):
    """The largest page id by one unsigned pass (a negative id outranks every valid one there): the bound run()
    checks the cache against, and a clear error naming the smallest id where one is negative."""
    ids = np.array([5, 0, 100, 7], dtype=dtype)
    t = paged.from_csr([0, 2, 4], ids, [1, 1], page_size=16)
    assert t.max_page_index == 100
    if np.issubdtype(dtype, np.signedinteger):
        ids[2] = -2
        with pytest.raises(ValueError, match="kv_indices: expected page ids >= 0, got -2"):
            paged.from_csr([0, 2, 4], ids, [1, 1], page_size=16)


def test_either_form_takes_one_form_whole():
    """plan()'s page table (decode, MLA, prefill): the CSR arrays or seq_lens= and block_table=, never both, and
    neither form in part; each form gives the same table."""
    csr = paged.from_either_form([0, 2, 2, 5], [3, 1, 0, 2, 4], [5, 0, 1], None, None, 16)
    table = np.array([[3, 1, -1], [-1, -1, -1], [0, 2, 4]])
    vllm = paged.from_either_form(None, None, None, [21, 0, 33], table, 16)
    assert csr.kv_len.tolist() == vllm.kv_len.tolist() == [21, 0, 33]
    assert csr.indices.tolist() == vllm.indices.tolist() and csr.indptr.tolist() == vllm.indptr.tolist()
    for name, extra in (("kv_indptr", ([0, 2, 2, 5], None, None)), ("kv_indices", (None, [3, 1, 0, 2, 4], None)),
                        ("kv_last_page_len", (None, None, [5, 0, 1]))):
        with pytest.raises(TypeError, match=f"got both \\({name} beside"):
            paged.from_either_form(*extra, [21, 0, 33], table, 16)
    with pytest.raises(TypeError, match="got None for kv_indices, kv_last_page_len"):
        paged.from_either_form([0, 2, 2, 5], None, None, None, None, 16)


def test_block_tables_give_the_csr_tables_of_their_used_slots():
    """from_block_table against from_csr of the same pages: equal and unequal requests (the equal ones take the
    table's columns as they are), empty requests, -1 past the used slots, every integer dtype and a Fortran-ordered
    table; a negative id in a used slot is refused, one past them is not read."""
    rng = np.random.default_rng(3)
    for draw in range(40):
        b, width = int(rng.integers(1, 20)), int(rng.integers(1, 40))
        lens = rng.integers(0, width * 16 + 1, size=b) if draw % 3 else np.full(b, int(rng.integers(0, width * 16)))
        pages = -(-lens // 16)
        dtype = np.dtype(rng.choice([np.int32, np.int64, np.uint32]) if draw % 4 else np.int64)
        table = np.full((b, width), -1 if dtype.kind == "i" else np.iinfo(dtype).max, dtype=dtype)  # (unused slots)
        for r in range(b):
            table[r, :pages[r]] = rng.permutation(1000)[:pages[r]]
        if draw % 5 == 0:
            table = np.asfortranarray(table)
        got = paged.from_block_table(lens, table, 16)
        indptr = np.concatenate([[0], np.cumsum(pages)])
        indices = np.concatenate([table[r, :pages[r]] for r in range(b)])
        want = paged.from_csr(indptr, indices, np.where(pages > 0, lens - (pages - 1) * 16, 0), 16)
        assert got.indptr.tolist() == want.indptr.tolist() and got.indices.tolist() == want.indices.tolist()
        assert got.kv_len.tolist() == want.kv_len.tolist() and got.max_page_index == want.max_page_index
    with pytest.raises(ValueError, match=r"block_table: expected page ids >= 0 in the slots seq_lens uses, got -2"):
        paged.from_block_table([20, 5], np.array([[3, -2], [4, -1]]), 16)


@pytest.mark.parametrize("longest", [(1 << 15) - 1, 1 << 15])
def test_block_tables_past_a_16_bit_page_count(longest):
    """The used-slot mask compares page counts in 16 bits while they fit and in 64 past that (page 1: a 32K-token
    request is 32K pages), so the request at the bound and the one past it both keep exactly their slots."""
    table = np.arange(2 * (longest + 3), dtype=np.int64).reshape(2, longest + 3)
    got = paged.from_block_table([longest, 5], table, page_size=1)
    assert got.indptr.tolist() == [0, longest, longest + 5]
    assert got.indices.tolist() == list(range(longest)) + list(range(longest + 3, longest + 8))
