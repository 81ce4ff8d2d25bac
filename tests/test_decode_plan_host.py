"""BatchDecode.plan on the host, with the CUDA calls stubbed: what it writes for the kernel and which
earlier copy it waits for (two pinned staging buffers used in turn)."""
import numpy as np
import pytest

from attnforge import AttentionSpec
from attnforge.decode import BatchDecode, grid_ctas
from attnforge.jit.upload import HostOnlyUpload


def host_wrapper() -> BatchDecode:
    return BatchDecode.host_only(AttentionSpec(num_qo_heads=32, num_kv_heads=8), max_batch_size=16,
                                 max_num_pages=1 << 10)


def table(lengths, page_size=16):
    pages = [-(-n // page_size) for n in lengths]
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    indices = np.random.default_rng(len(lengths)).permutation(indptr[-1]).astype(np.int32)
    last = np.array([n - (p - 1) * page_size for n, p in zip(lengths, pages)], dtype=np.int32)
    return indptr, indices, last


def test_plan_waits_for_the_copy_two_plans_back_and_writes_what_it_was_given():
    w = host_wrapper()
    tables = [table([100, 17, 1000]), table([5, 4096]), table([1, 2, 3, 700])]
    for t in tables:
        w.plan(*t, page_size=16)
        indptr, indices, _ = t
        # the kernel's device buffer is a copy of the buffer just written: it holds this plan's table
        got = w._upload.dev  # on this stand-in the "device" buffer lives on the host
        off, _ = w._offsets["kv_indices"]
        assert np.array_equal(got[off:off + len(indices)].numpy(), indices)
        off, _ = w._offsets["kv_indptr"]
        assert np.array_equal(got[off:off + len(indptr)].numpy(), indptr)
    # plans 1 and 2 use buffers 0 and 1 and wait for nothing; plan 3 reuses buffer 0 and waits for
    # plan 1's copy only, before writing it
    assert w._upload.log == [("record", 0), ("record", 1), ("wait", 0), ("record", 0)]


def test_growing_the_page_buffers_drains_the_old_copies_first():
    w = host_wrapper()
    w.plan(*table([100, 17]), page_size=16)
    w.plan(*table([5, 40]), page_size=16)
    old = w._upload
    big = table([16 * 1024, 16 * 1024])  # 2048 pages > max_num_pages=1024: the buffers grow
    w.plan(*big, page_size=16)
    assert w._upload is not old and old.log[-2:] == [("wait", 0), ("wait", 1)]
    off, _ = w._offsets["kv_indices"]
    assert np.array_equal(w._upload.dev[off:off + len(big[1])].numpy(), big[1])


def test_upload_refuses_to_copy_past_its_buffers():
    up = HostOnlyUpload(64)
    up.host()[:] = 7
    up.upload(64)
    assert (up.dev.numpy() == 7).all()
    with pytest.raises(ValueError, match="exceed the 64-value buffers"):
        up.upload(65)


def test_grid_ctas_defaults_to_the_occupancy_and_takes_fewer():
    assert grid_ctas(132, 3) == 396 and grid_ctas(132, 3, 1) == 132 and grid_ctas(132, 2, 2) == 264
    for bad in (0, 4, 1.5, True, "2"):
        with pytest.raises(ValueError, match=r"ctas_per_sm: expected an int in \[1, 3\]"):
            grid_ctas(132, 3, bad)

