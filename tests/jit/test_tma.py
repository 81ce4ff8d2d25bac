"""Which paged caches the copy engine can tile (attnforge/jit/tma.py), decided without a GPU."""
import pytest

from attnforge.jit.tma import MIN_BOX_ROWS, paged_kv_box, ragged_kv_box

H, D = 8, 128


def nhd(page, pages=100, d=D, pair=False):
    """Strides (elements) of K in a [P, 2, page, H, d] cache, or of a [P, page, H, d] K tensor (pair)."""
    return dict(head_dim=d, num_heads=H, page_size=page, num_pages=pages, stride_page=(1 if pair else 2) * page * H * d,
                stride_token=H * d, stride_head=d, elem_bytes=2, tile_kv=128)


def hnd(page, pages=100, d=D):
    return dict(head_dim=d, num_heads=H, page_size=page, num_pages=pages, stride_page=2 * page * H * d,
                stride_token=d, stride_head=page * d, elem_bytes=2, tile_kv=128)


@pytest.mark.parametrize("page", [8, 16, 32, 64, 128])
def test_pages_that_tile_the_tile_are_one_box_each(page):
    box, why = paged_kv_box(**nhd(page))
    assert why == "" and box.rows == page and box.heads_inner
    assert box.dims == (D, H, page, 100) and box.box == (64, 1, page, 1)
    assert box.strides == (D * 2, H * D * 2, 2 * page * H * D * 2)


@pytest.mark.parametrize("page", [256, 1024])
def test_pages_longer_than_a_tile_give_the_tiles_share(page):
    box, _ = paged_kv_box(**nhd(page))
    assert box.rows == 128 and box.box == (64, 1, 128, 1)


def test_hnd_orders_tokens_inside_heads():
    box, why = paged_kv_box(**hnd(16))
    assert why == "" and not box.heads_inner
    assert box.dims == (D, 16, H, 100) and box.box == (64, 16, 1, 1)
    assert box.strides == (D * 2, 16 * D * 2, 2 * 16 * H * D * 2)


def test_a_k_tensor_of_a_pair_is_its_own_pages():
    box, _ = paged_kv_box(**nhd(16, pair=True))
    assert box.strides[2] == 16 * H * D * 2


@pytest.mark.parametrize("page", [1, 4, 7, 24, 48, 96, 200])
def test_pages_that_do_not_tile_fall_back(page):
    box, why = paged_kv_box(**nhd(page))
    assert box is None and f"page_size {page}" in why
    assert page < MIN_BOX_ROWS or 128 % page or page > 128


def test_ragged_kv_is_one_page_of_every_token():
    box, why = ragged_kv_box(D, H, 1000, H * D, D, 2, 128)  # [tokens, H, D]
    assert why == "" and box.heads_inner and box.rows == 128
    assert box.dims == (D, H, 1000, 1) and box.box == (64, 1, 128, 1)
    assert box.strides[:2] == (D * 2, H * D * 2) and box.strides[2] >= 1000 * H * D * 2
    # every token's K and V interleaved ([tokens, 2, H, D] viewed as K): a wider token stride
    assert ragged_kv_box(D, H, 1000, 2 * H * D, D, 2, 128)[0].strides[1] == 2 * H * D * 2
    # heads outside tokens ([H, tokens, D] viewed as [tokens, H, D]): tokens become the inner dimension
    box, _ = ragged_kv_box(D, H, 1000, D, 1000 * D, 2, 128)
    assert not box.heads_inner and box.dims == (D, 1000, H, 1) and box.box == (64, 128, 1, 1)
    assert "1 to 2^32" in ragged_kv_box(D, H, 0, H * D, D, 2, 128)[1]


@pytest.mark.parametrize("page,rows", [(16, 16), (64, 64), (256, 128)])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_fp8_rows_are_whole_head_rows_swizzled_at_128_bytes(page, rows, d):
    """fp8 staging (the wgmma prefill producer widens it after): boxes [rows][head_dim] of bytes, swizzled
    like sw128 exactly when a row is 128 bytes (the kernel's Fp8Loader stages head_dim 128 swizzled)."""
    kw = {**nhd(page, d=d), "elem_bytes": 1, "stride_page": 2 * page * H * d}
    box, why = paged_kv_box(**kw, plain_rows=True)
    assert why == "" and box.rows == rows and box.swizzle == (d == 128) and box.box == (d, 1, rows, 1)
    assert box.strides == (d, H * d, 2 * page * H * d)
    rag, _ = ragged_kv_box(d, H, 1000, H * d, d, 1, 128, plain_rows=True)
    assert rag.box == (d, 1, 128, 1) and rag.swizzle == (d == 128)
    assert "one-byte" in paged_kv_box(**nhd(16), plain_rows=True)[1]  # 16-bit K/V keeps its sw128 boxes
    assert paged_kv_box(**nhd(16))[0].swizzle


def test_other_refusals_say_why():
    assert "16-bit" in paged_kv_box(**{**nhd(16), "elem_bytes": 1})[1]
    assert "multiple of 64" in paged_kv_box(**nhd(16, d=96))[1]
    # a token stride smaller than its heads' extent (overlapping rows) or not a multiple of 16 bytes
    assert "non-overlapping" in paged_kv_box(**{**nhd(16), "stride_token": D})[1]
    assert "multiples of 16" in paged_kv_box(**{**nhd(16), "stride_token": H * D + 4})[1]
    assert "2^32" in paged_kv_box(**nhd(16, pages=2**32))[1]


def test_encode_arguments_marshal_through_cuda_python():
    """cuda-python converts every argument before it looks for the driver: a type it rejects raises
    TypeError here even without a GPU (the call may then fail only for want of a driver)."""
    drv = pytest.importorskip("cuda.bindings.driver")
    from attnforge.jit.tma import encode_args
    bf16, _ = paged_kv_box(**nhd(16))
    fp8, _ = paged_kv_box(**{**nhd(16, d=64), "elem_bytes": 1}, plain_rows=True)  # unswizzled byte rows
    types = drv.CUtensorMapDataType
    for kind, box in ((types.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, bf16), (types.CU_TENSOR_MAP_DATA_TYPE_UINT8, fp8)):
        args = encode_args(drv, kind, 1 << 20, box)
        assert args[8] == (drv.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B if box.swizzle
                           else drv.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE)
        try:
            err, _ = drv.cuTensorMapEncodeTiled(*args)
        except TypeError as e:
            pytest.fail(f"cuda-python rejected an argument: {e}")
        except Exception as e:  # no driver on this machine: the arguments were converted before the lookup
            assert "driver" in str(e).lower(), e
        else:
            assert err in (drv.CUresult.CUDA_SUCCESS, drv.CUresult.CUDA_ERROR_NOT_INITIALIZED), err


def test_encode_arguments_name_the_box_l2_promotion():
    """KVBox.l2_promotion picks the driver's enum member (none, 64, 128 or 256 bytes); other sizes are refused."""
    import dataclasses

    from attnforge.jit.tma import encode_args

    class Names:
        cuuint32_t = cuuint64_t = int
        CUtensorMapInterleave = CUtensorMapSwizzle = CUtensorMapL2promotion = CUtensorMapFloatOOBfill = \
            type("Enum", (), {"__getattr__": lambda self, name: name})()

    box, _ = paged_kv_box(**nhd(16))
    assert box.l2_promotion == 256 and encode_args(Names, "bf16", 0, box)[9] == "CU_TENSOR_MAP_L2_PROMOTION_L2_256B"
    for size, name in ((0, "NONE"), (64, "L2_64B"), (128, "L2_128B")):
        assert encode_args(Names, "bf16", 0, dataclasses.replace(box, l2_promotion=size))[9] == \
            "CU_TENSOR_MAP_L2_PROMOTION_" + name
    with pytest.raises(ValueError, match=r"l2_promotion: expected one of \(0, 64, 128, 256\) bytes, got 32"):
        encode_args(Names, "bf16", 0, dataclasses.replace(box, l2_promotion=32))


def test_encode_refuses_what_the_copy_engine_cannot_take_before_any_driver_call():
    import torch

    from attnforge.jit.tma import encode
    box, _ = paged_kv_box(**nhd(16))
    with pytest.raises(ValueError, match="expected a 16-byte aligned bf16/fp16/fp8 e4m3 tensor, got torch.float32.*tma=False"):
        encode(torch.zeros(4, 16, H, D), box)
    misaligned = torch.zeros(4 * 16 * H * D + 1, dtype=torch.bfloat16)[1:]  # 2 bytes past an aligned start
    with pytest.raises(ValueError, match="16-byte aligned"):
        encode(misaligned, box)


def test_encode_asks_the_driver_once_per_tensor_and_box(monkeypatch):
    """The 128 map bytes come from the driver's 16 words in order, and a second run of the same layer
    reuses them (a driver call per launch would cost microseconds)."""
    import torch

    from attnforge.jit import loader, tma

    class FakeDriver:
        cuuint32_t = cuuint64_t = int
        CUtensorMapDataType = CUtensorMapInterleave = CUtensorMapSwizzle = CUtensorMapL2promotion = \
            CUtensorMapFloatOOBfill = type("Enum", (), {"__getattr__": lambda self, name: name})()
        calls = 0

        def cuTensorMapEncodeTiled(self, *args):
            FakeDriver.calls += 1
            return "ok", type("Map", (), {"opaque": list(range(16))})()

    monkeypatch.setattr(loader, "driver", lambda: FakeDriver())
    monkeypatch.setattr(loader, "check", lambda result, call: result[1])
    monkeypatch.setattr(loader, "ensure_context", lambda device: None)
    monkeypatch.setattr(tma, "_MAPS", {})
    box, _ = paged_kv_box(**nhd(16))
    t = torch.zeros(4, 16, H, D, dtype=torch.bfloat16)
    raw = tma.encode(t, box)
    assert raw == b"".join(i.to_bytes(8, "little") for i in range(16))
    assert tma.encode(t, box) is raw and FakeDriver.calls == 1
    tma.encode(t, paged_kv_box(**nhd(32))[0])  # another box: another map
    assert FakeDriver.calls == 2


def test_query_tiles_are_one_box_of_tokens_by_group_heads():
    from attnforge.jit.tma import q_box
    box, why = q_box(D, 32, 4, 128, 5000, 32 * D, D, 2)  # [tokens, 32 heads, D], groups of 4
    assert why == "" and box.rows == 32 and box.box == (64, 4, 32, 1)  # 32 tokens x 4 heads = 128 rows
    assert box.dims == (D, 32, 5000, 1) and box.strides[:2] == (D * 2, 32 * D * 2)
    assert q_box(256, 8, 8, 64, 10, 8 * 256, 256, 2)[0].box == (64, 8, 8, 1)  # head_dim 256: 64-row tiles
    for args, reason in [((D, 12, 6, 128, 100, 12 * D, D, 2), "divides the 128-row tile"),  # 128 % 6
                         ((D, 32, 4, 128, 100, D, 100 * D, 2), "heads innermost"),  # [heads, tokens, D] view
                         ((D, 32, 4, 128, 100, 32 * D, D, 4), "16-bit")]:  # fp32
        box, why = q_box(*args)
        assert box is None and reason in why
