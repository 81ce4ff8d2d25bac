"""The mod library's argument checks (attnforge/mods/library_args.py): each factory refuses a wrong type, shape or
value with expected / got / fix before tracing, and prefix_lm takes one int for every request."""
import pytest
import torch

import attnforge.mods as m

VALID = {"alibi": dict(slopes=torch.rand(8)), "attention_sink": dict(sink_logits=torch.zeros(8)),
         "document_mask": dict(doc_ids=torch.zeros(2, 64, dtype=torch.int32)),
         "prefix_lm": dict(prefix_len=torch.tensor([3, 4])),
         "relative_position_bias": dict(table=torch.zeros(8, 33), max_distance=16),
         "sliding_window": dict(window=64), "softcap": dict(cap=30.0)}

BAD = [  # (factory, argument, value, what the message says it got)
    ("alibi", "slopes", 0.5, "float 0.5"), ("alibi", "slopes", torch.rand(8, 2), r"shape \[8, 2\]"),
    ("alibi", "slopes", torch.ones(8, dtype=torch.bool), "torch.bool"),
    ("attention_sink", "sink_logits", None, "NoneType"), ("attention_sink", "sink_logits", [0.0] * 8, "list"),
    ("document_mask", "doc_ids", torch.zeros(2, 64), "torch.float32"),  # (ids: an integer tensor)
    ("document_mask", "doc_ids", torch.zeros(64, dtype=torch.int32), r"shape \[64\]"),
    ("document_mask", "causal", 1, "int 1"),
    ("prefix_lm", "prefix_len", 2.5, "float 2.5"), ("prefix_lm", "prefix_len", -1, "-1"),
    ("prefix_lm", "prefix_len", True, "bool True"), ("prefix_lm", "prefix_len", torch.tensor([3.0]), "float32"),
    ("relative_position_bias", "max_distance", "16", "'16'"),
    ("relative_position_bias", "max_distance", -2, "-2"),
    ("relative_position_bias", "table", 7, "int 7"),
    ("relative_position_bias", "table", torch.zeros(8, 31), r"\[8, 31\]"),  # (one column short: read past its end)
    ("sliding_window", "window", 64.0, "64.0"), ("sliding_window", "window", True, "True"),
    ("softcap", "cap", 0.0, "float 0.0"), ("softcap", "cap", float("inf"), "float inf"),
    ("softcap", "cap", "50", "str '50'"), ("softcap", "cap", torch.tensor([50.0]), r"shape \[1\]"),
]


@pytest.mark.parametrize("factory,arg,value,got", BAD, ids=[f"{f}-{a}-{g}" for f, a, _, g in BAD])
def test_each_factory_refuses_what_it_cannot_use(factory, arg, value, got):
    getattr(m, factory)(**VALID[factory])  # (the valid call is taken)
    with pytest.raises((TypeError, ValueError), match=rf"{factory}\({arg}=\.\.\.\): expected .*got .*{got}"):
        getattr(m, factory)(**{**VALID[factory], arg: value})


def test_a_runtime_softcap_is_a_0d_tensor():
    cap = torch.tensor(50.0)
    mod = m.softcap(cap)
    assert mod.scalar_sources == [cap]  # (read at each launch)


def test_prefix_lm_takes_one_int_for_every_request():
    """prefix_lm(5) masks as prefix_lm(tensor([5, 5])) does, with the length compiled in (no captured tensor)."""
    by_int, by_tensor = m.prefix_lm(5), m.prefix_lm(torch.tensor([5, 5]))
    assert by_int.tensors == [] and len(by_tensor.tensors) == 1
    q, kv = torch.arange(12)[:, None], torch.arange(12)[None, :]
    for b in (0, 1):
        want = (kv <= q) | (kv < 5)
        assert torch.equal(by_int.torch_mask(torch.tensor(b), torch.tensor(0), q, kv), want)
        assert torch.equal(by_tensor.torch_mask(torch.tensor(b), torch.tensor(0), q, kv), want)
