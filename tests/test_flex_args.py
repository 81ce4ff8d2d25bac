"""attention()'s FlexAttention arguments on the CPU (attnforge/flex_args.py), launches stubbed: a flex_attention call
carries over with its positional order, kernel_options and return_aux; a modifier that is not a function, and each
misuse of those arguments, is refused with expected / got / fix before any launch."""
import functools

import pytest
import torch

from attnforge import dense, flex_args, mods
from helpers import stub_host_prefill

flex = pytest.importorskip("torch.nn.attention.flex_attention")


@pytest.fixture
def recorder(monkeypatch):
    monkeypatch.setattr(dense, "_CALLS", {})  # (entries of other tests hold their stubbed libraries)
    return stub_host_prefill(monkeypatch, lambda t, box: bytes(128))


def inputs(lq=256, lk=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 8, lq, 128, generator=g).bfloat16()
    k, v = (torch.randn(2, 2, lk, 128, generator=g).bfloat16() for _ in range(2))
    return q, k, v


DOCS = torch.arange(256) // 100


def same_doc(b, h, qi, ki):
    return (DOCS[qi] == DOCS[ki]) & (qi >= ki)


def tilt(s, b, h, qi, ki):
    return s + 0.01 * (ki - qi)


def planned_mods(monkeypatch) -> list:
    """The modifier each attention() call plans with (dense_call's fourth argument)."""
    seen = []
    monkeypatch.setattr(dense, "dense_call", lambda *a, call=dense.dense_call: seen.append(a[3]) or call(*a))
    return seen


def test_flex_positional_arguments_run_as_their_keywords(recorder, monkeypatch):
    """flex_attention(q, k, v, score_mod, block_mask, scale, enable_gqa, return_lse, kernel_options) spelled
    positionally reaches attnforge.attention as its keyword form does: the BlockMask in mask_mod's place is taken
    as block_mask (not traced as a function), the scale reaches the kernel, and (out, lse) comes back."""
    q, k, v = inputs()
    seen = planned_mods(monkeypatch)
    bm = flex.create_block_mask(same_doc, None, None, 256, 256, device="cpu")
    by_name = dense.attention(q, k, v, score_mod=tilt, block_mask=bm, scale=0.09, enable_gqa=True, return_lse=True)
    by_place = dense.attention(q, k, v, tilt, bm, 0.09, True, True, {"BLOCK_M": 64, "num_warps": 4})
    assert seen[0] is seen[1] and seen[0].mask_root is not None and seen[0].score_root is not None
    assert recorder.launches[-1][2].sm_scale == pytest.approx(0.09) == recorder.launches[-2][2].sm_scale
    assert [tuple(t.shape) for t in by_place] == [tuple(t.shape) for t in by_name] == [(2, 8, 256, 128), (2, 8, 256)]


def test_kernel_options_change_nothing_and_must_be_a_dict_by_name(recorder, monkeypatch):
    q, k, v = inputs()
    seen = planned_mods(monkeypatch)
    dense.attention(q, k, v, enable_gqa=True)
    dense.attention(q, k, v, enable_gqa=True, kernel_options={"BLOCK_M": 32, "BACKEND": "TRITON"})
    assert seen == [None, None] and len(recorder.launches) == 2
    assert recorder.launches[0][0] == recorder.launches[1][0]  # (the same kernel: the options chose nothing)
    for bad in (64, [("BLOCK_M", 64)], {64: "BLOCK_M"}, "BLOCK_M=64"):
        with pytest.raises(ValueError, match=r"kernel_options=.*expected None or a dict.*ignores them"):
            dense.attention(q, k, v, enable_gqa=True, kernel_options=bad)
    assert len(recorder.launches) == 2


def test_return_aux_gives_flexs_aux_output_with_the_lse(recorder):
    q, k, v = inputs(lq=64, lk=96)
    out, aux = dense.attention(q, k, v, enable_gqa=True, return_aux=flex.AuxRequest(lse=True))
    assert isinstance(aux, flex.AuxOutput) and aux.max_scores is None
    assert out.shape == q.shape and aux.lse.shape == (2, 8, 64) and aux.lse.dtype == torch.float32
    assert recorder.launches[-1][2].lse == aux.lse.data_ptr()  # (the kernel writes the LSE it returns)
    out, aux = dense.attention(q, k, v, enable_gqa=True, return_aux=flex.AuxRequest())
    assert aux == flex.AuxOutput(lse=None, max_scores=None) and not recorder.launches[-1][2].lse


@pytest.mark.parametrize("kw,error", [  # (Flex's arguments, and the flags a truthy string would turn on)
    ({"return_aux": flex.AuxRequest(lse=True, max_scores=True)}, r"max_scores=False.*AuxRequest\(lse=True\)"),
    ({"return_aux": flex.AuxRequest(lse=True), "return_lse": True}, "expected one of the two, got both"),
    ({"return_aux": (True, False)}, r"expected None or FlexAttention's AuxRequest"),
    ({"return_aux": True}, r"expected None or FlexAttention's AuxRequest"),
    ({"score_mod": 0.5}, r"score_mod=.*expected None or a function score_mod\(score, b, h, q_idx, kv_idx\), got "
                         r"float 0.5"),
    ({"return_lse": "no"}, r"attention\(return_lse=...\): expected True or False, got 'no'"),
    ({"enable_gqa": 1}, r"attention\(enable_gqa=...\): expected True or False, got 1"),
    ({"mask_mod": "causal"}, r"mask_mod=.*expected None or a function mask_mod\(b, h, q_idx, kv_idx\), got str"),
    ({"mask_mod": torch.ones(256, 256, dtype=torch.bool)}, r"mask_mod=.*got a torch.bool tensor of shape \[256, 256\]"),
    ({"score_mod": torch.zeros(256, 256)},
     r"score_mod=.*got a torch.float32 tensor.*SDPA's attn_mask.*pass it as attn_mask="),
])
def test_misused_arguments_are_refused_before_any_launch(recorder, kw, error):
    q, k, v = inputs()
    with pytest.raises((ValueError, TypeError), match=error):
        dense.attention(q, k, v, **{"enable_gqa": True, **kw})
    assert recorder.launches == []


def test_a_block_mask_in_both_places_is_refused(recorder):
    q, k, v = inputs()
    bm = flex.create_block_mask(same_doc, None, None, 256, 256, device="cpu")
    with pytest.raises(ValueError, match="a BlockMask in each"):
        dense.attention(q, k, v, None, bm, block_mask=bm, enable_gqa=True)
    assert recorder.launches == []


def test_callables_of_any_kind_are_taken_as_modifiers():
    """A partial or an object with __call__ is a function to trace, as for Flex; a BlockMask is told apart from a
    mask_mod by what it holds, not by being callable."""
    class Capped:
        def __call__(self, s, b, h, qi, ki):
            return 30.0 * torch.tanh(s / 30.0)
    for fn in (Capped(), functools.partial(lambda s, b, h, qi, ki, c: s * c, c=0.5)):
        flex_args.check_modifier_functions(fn, same_doc)
        assert mods.compile_mod(score_mod=fn).score_root is not None
    bm = flex.create_block_mask(same_doc, None, None, 256, 256, device="cpu")
    assert flex_args.is_block_mask(bm) and not flex_args.is_block_mask(same_doc)
    assert flex_args.positional_block_mask(same_doc, None) == (same_doc, None)
    assert flex_args.positional_block_mask(bm, None) == (None, bm)
