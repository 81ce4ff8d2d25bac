"""More APIs for the bad-input fuzz (tests/input_fuzz.py): decode's LSE buffer, fp8 cache and verify step, MLA's
one 576-wide cache and block table, prefill's block table, cascade, Quest (a selection per request or per KV head),
single_prefill, merge_state, the slot-mapped and MLA appends, attention() of one query on the decode kernels and
single_decode.
Each is a valid call as a dict of named arguments, its mutations, and how to invoke it (input_fuzz_apis.Api);
APIS is every call form the fuzz runs."""
from __future__ import annotations

import contextlib
import os

import numpy as np
import torch

import attnforge
from attnforge import AttentionSpec, BatchDecode, BatchMLADecode, BatchPrefill
from attnforge.cascade import CascadeDecode
from attnforge.sparse import QuestDecode, QuestHeadDecode, QuestIndex
from input_fuzz import EITHER, REFUSE, SAME, Mutation, decode_out, index_array, misaligned, retag, scale, tensor
from input_fuzz_apis import (COPIED, CORE_APIS, DECODE_SPEC, MLA_SPEC, NUM_PAGES, PAGE, PLAN_SCALARS, PREFILL_SPEC, Api,
                             Env, _as_block_table, _csr, _plan_kwargs, _plan_mutations, _rand, _with, attention_build,
                             attention_invoke, attention_mutations, decode_build, mla_build, prefill_build)


def decode_lse_build(env: Env) -> dict:
    a = decode_build(env)
    a["lse"] = torch.full((3, 8), float("nan"), device=env.device)
    return a


def decode_lse_mutations(a: dict, env: Env) -> list:
    m = [x for x in tensor("lse", a["lse"], env.gpu) if x.name not in ("float32", "misaligned", "padded-rows")]
    return m + [Mutation("lse", "transposed", REFUSE, lambda t: t.T.contiguous().T),
                Mutation("lse", "bf16", REFUSE, lambda t: t.bfloat16()),
                Mutation("lse", "4-byte-aligned", EITHER, misaligned)]  # (scalar stores)


def decode_lse_invoke(env: Env, a: dict):
    w = env.wrapper(BatchDecode, DECODE_SPEC)
    w.plan(a["kv_indptr"], a["kv_indices"], a["kv_last_page_len"], **_plan_kwargs(a))
    return w.run(a["q"], a["kv_cache"], out=a["out"], lse=a["lse"], return_lse=True)


FP8_SPEC = AttentionSpec(num_qo_heads=8, num_kv_heads=2, kv_dtype="fp8_e4m3")


def decode_fp8_build(env: Env) -> dict:
    a = decode_build(env)
    a.update(kv_cache=a["kv_cache"].float().mul(2).to(torch.float8_e4m3fn), k_scale=0.5, v_scale=2.0)
    return a


def decode_fp8_mutations(a: dict, env: Env) -> list:
    m = scale("k_scale") + scale("v_scale")
    return m + [x for x in tensor("kv_cache", a["kv_cache"], env.gpu) if x.name != "int32"] + \
        [Mutation("kv_cache", "bf16", REFUSE, lambda t: t.to(torch.bfloat16)),
         Mutation("kv_cache", "uint8-view", REFUSE, lambda t: t.view(torch.uint8))]


def decode_fp8_invoke(env: Env, a: dict):
    w = env.wrapper(BatchDecode, FP8_SPEC)
    w.plan(a["kv_indptr"], a["kv_indices"], a["kv_last_page_len"], **_plan_kwargs(a))
    return w.run(a["q"], a["kv_cache"], out=a["out"])


# -- speculative decoding's verify step: two tokens a request, an HND cache ------------------------------------
VERIFY_SPEC = AttentionSpec(num_qo_heads=8, num_kv_heads=2, kv_layout="HND")


def verify_build(env: Env) -> dict:
    a = decode_build(env)
    g = torch.Generator().manual_seed(11)
    a.update(q_len=2, q=_rand(g, (6, 8, 128), torch.bfloat16, env.device),
             kv_cache=a["kv_cache"].transpose(2, 3).contiguous(), out=a["out"].repeat(2, 1, 1))
    return a


def verify_mutations(a: dict, env: Env) -> list:
    m = [Mutation("q_len", v, REFUSE, lambda x, v=v: int(v)) for v in ("0", "3")]
    m += [Mutation("q_len", "one-token", REFUSE, lambda x: 1)]  # (q then holds two rows a request)
    m += [Mutation("kv_cache", "NHD", REFUSE, lambda t: t.transpose(2, 3).contiguous())]  # page 16 vs 2 heads
    return m + tensor("q", a["q"], env.gpu) + tensor("kv_cache", a["kv_cache"], env.gpu) + \
        decode_out("out", a["out"], env.gpu)


def verify_invoke(env: Env, a: dict):
    w = env.wrapper(BatchDecode, VERIFY_SPEC, max_q_len=2)
    w.plan(a["kv_indptr"], a["kv_indices"], a["kv_last_page_len"], **_plan_kwargs(a))
    return w.run(a["q"], a["kv_cache"], out=a["out"])


def mla_block_table_build(env: Env) -> dict:
    return _as_block_table(mla_build(env))


def mla_block_table_mutations(a: dict, env: Env) -> list:
    return index_array("seq_lens", a["seq_lens"], env.gpu) + \
        [Mutation("block_table", "transposed", REFUSE, lambda t: np.ascontiguousarray(np.asarray(t).T)),
         Mutation("block_table", "id-past-cache", REFUSE, lambda t: _with(t, (2, 0), NUM_PAGES)),
         Mutation("block_table", "strided", SAME, lambda t: np.repeat(np.asarray(t), 2, axis=1)[:, ::2])]


def mla_block_table_invoke(env: Env, a: dict):
    w = env.wrapper(BatchMLADecode, MLA_SPEC)
    w.plan(seq_lens=a["seq_lens"], block_table=a["block_table"], **_plan_kwargs(a))
    return w.run(a["q_nope"], a["q_pe"], a["ckv_cache"], a["kpe_cache"], out=a["out"])


def prefill_block_table_build(env: Env) -> dict:
    return _as_block_table(prefill_build(env))


def prefill_block_table_mutations(a: dict, env: Env) -> list:
    return index_array("seq_lens", a["seq_lens"], env.gpu) + \
        [Mutation("block_table", "1d", REFUSE, lambda t: np.asarray(t).reshape(-1)),
         Mutation("block_table", "one-row-short", REFUSE, lambda t: np.asarray(t)[:-1]),
         Mutation("block_table", "narrow", REFUSE, lambda t: np.asarray(t)[:, :6]),  # 7 pages needed
         Mutation("block_table", "id-past-cache", REFUSE, lambda t: _with(t, (2, 0), NUM_PAGES)),
         Mutation("block_table", "negative-id", REFUSE, lambda t: _with(t, (2, 0), -1)),
         Mutation("block_table", "wider", SAME, lambda t: np.pad(np.asarray(t), ((0, 0), (0, 4)), constant_values=-7))]


def prefill_block_table_invoke(env: Env, a: dict):
    w = env.wrapper(BatchPrefill, PREFILL_SPEC)
    w.plan(a["qo_indptr"], seq_lens=a["seq_lens"], block_table=a["block_table"], **{k: a[k] for k in PLAN_SCALARS})
    return w.run(a["q"], a["kv_cache"], out=a["out"])


def mla_unified_build(env: Env) -> dict:
    a = mla_build(env)
    a["ckv_cache"] = torch.cat([a["ckv_cache"], a.pop("kpe_cache")], -1)
    return a


def mla_unified_mutations(a: dict, env: Env) -> list:
    return tensor("ckv_cache", a["ckv_cache"], env.gpu) + \
        [Mutation("ckv_cache", "575-wide", REFUSE, lambda t: t[..., :575].contiguous()),
         Mutation("ckv_cache", "577-wide", REFUSE, lambda t: torch.cat([t, t[..., :1]], -1))]


def mla_unified_invoke(env: Env, a: dict):
    w = env.wrapper(BatchMLADecode, MLA_SPEC)
    w.plan(a["kv_indptr"], a["kv_indices"], a["kv_last_page_len"], **_plan_kwargs(a))
    return w.run(a["q_nope"], a["q_pe"], a["ckv_cache"], out=a["out"])


# -- CascadeDecode: one shared level (pages 6-9 shared by requests 0-1; request 2's group none), suffixes in 0-5 ---
def cascade_build(env: Env) -> dict:
    g = torch.Generator().manual_seed(7)
    suffix = _csr((20, 9, 33), PAGE, 2 + 1 + 3, g)
    return {"group_indptr": np.array([0, 2, 3], np.int32), "level_kv_indptr": np.array([0, 4, 4], np.int32),
            "level_kv_indices": np.array([6, 7, 8, 9], np.int32), "level_last": np.array([16, 16], np.int32),
            "suffix_kv_indptr": suffix[0], "suffix_kv_indices": suffix[1], "suffix_last": suffix[2],
            "q": _rand(g, (3, 8, 128), torch.bfloat16, env.device),
            "kv_cache": _rand(g, (10, 2, PAGE, 2, 128), torch.bfloat16, env.device),
            "out": torch.full((3, 8, 128), float("nan"), dtype=torch.bfloat16, device=env.device)}


def cascade_mutations(a: dict, env: Env) -> list:
    m = index_array("group_indptr", a["group_indptr"], env.gpu) + index_array("suffix_kv_indptr", a["suffix_kv_indptr"],
                                                                              env.gpu)
    m += index_array("level_kv_indices", a["level_kv_indices"], env.gpu)
    m += index_array("suffix_last", a["suffix_last"], env.gpu, bad_value=0)
    m += [Mutation("group_indptr", "not-covering", REFUSE, lambda x: np.array([0, 2], np.int32))]
    return m + tensor("q", a["q"], env.gpu) + tensor("kv_cache", a["kv_cache"], env.gpu) + \
        retag(tensor("out", a["out"], env.gpu), EITHER, "misaligned")  # (the final merge stores elements)


def cascade_invoke(env: Env, a: dict):
    c = CascadeDecode(DECODE_SPEC, max_batch_size=4)
    level = (a["group_indptr"], a["level_kv_indptr"], a["level_kv_indices"], a["level_last"])
    c.plan([level], (a["suffix_kv_indptr"], a["suffix_kv_indices"], a["suffix_last"]), page_size=PAGE)
    return c.run(a["q"], a["kv_cache"], out=a["out"])


# -- QuestDecode: page summaries of every held key, a budget of 3 pages ---------------------------------------
def quest_build(env: Env) -> dict:
    a = decode_build(env)
    a["index_cache"] = a["kv_cache"]  # the summaries are built from this cache at the call (see quest_invoke)
    return a


def quest_mutations(a: dict, env: Env) -> list:
    m = [x for x in _plan_mutations(a, env) if x.arg != "q_len" and not x.arg.startswith("page_size")]
    return m + tensor("q", a["q"], env.gpu) + tensor("kv_cache", a["kv_cache"], env.gpu) + \
        decode_out("out", a["out"], env.gpu)


def _quest_index(env: Env, keys: torch.Tensor) -> QuestIndex:
    """Summaries of every cache page's keys [pages, page, Hkv, D]."""
    index = QuestIndex(NUM_PAGES, 2, 128, device=env.device)
    index.append(keys.reshape(-1, 2, 128), torch.arange(NUM_PAGES, device=env.device).repeat_interleave(PAGE))
    return index


def quest_invoke(env: Env, a: dict):
    index = _quest_index(env, a["index_cache"][:, 0].float())  # (NHD: [pages, page, Hkv, D])
    quest = QuestDecode(DECODE_SPEC, index, budget_tokens=3 * PAGE, page_size=PAGE,
                        max_batch_size=4, max_num_pages=NUM_PAGES, max_pages_per_request=8)
    quest.plan(a["kv_indptr"], a["kv_indices"], a["kv_last_page_len"],
               **{k: a[k] for k in ("sm_scale", "k_scale", "v_scale")})
    return quest.run(a["q"], a["kv_cache"], out=a["out"])


# -- QuestHeadDecode: a selection per (request, KV head) over an HND cache, a budget of 3 pages -----------------
def quest_heads_build(env: Env) -> dict:
    a = quest_build(env)
    a["kv_cache"] = a["index_cache"] = a["kv_cache"].transpose(2, 3).contiguous()  # [P, 2, Hkv, page, D]
    return a


def quest_heads_mutations(a: dict, env: Env) -> list:
    m = [Mutation("kv_cache", "NHD", REFUSE, lambda t: t.transpose(2, 3).contiguous())]  # page 16 vs 2 heads
    # (q is read per KV head's group as q.reshape: a strided q is copied there, as SDPA takes any layout)
    return m + retag(quest_mutations(a, env), EITHER, "strided-last")


def quest_heads_invoke(env: Env, a: dict):
    index = _quest_index(env, a["index_cache"][:, 0].transpose(1, 2).float())  # (HND: [pages, Hkv, page, D])
    quest = QuestHeadDecode(QUEST_HEADS_SPEC, index, budget_tokens=3 * PAGE, page_size=PAGE,
                            max_batch_size=4, max_num_pages=NUM_PAGES, max_pages_per_request=8)
    quest.plan(a["kv_indptr"], a["kv_indices"], a["kv_last_page_len"],
               **{k: a[k] for k in ("sm_scale", "k_scale", "v_scale")})
    return quest.run(a["q"], a["kv_cache"], out=a["out"])


QUEST_HEADS_SPEC = AttentionSpec(num_qo_heads=8, num_kv_heads=2, kv_layout="HND")


# -- single_prefill, merge_state, append_kv_by_slots ------------------------------------------------------------
def single_build(env: Env) -> dict:
    g = torch.Generator().manual_seed(8)
    shapes = {"q": (40, 8, 128), "k": (70, 2, 128), "v": (70, 2, 128)}
    return {**{n: _rand(g, s, torch.bfloat16, env.device) for n, s in shapes.items()}, "sm_scale": 0.1}


def single_mutations(a: dict, env: Env) -> list:
    m = scale("sm_scale", refuse_zero=False)
    for arg in ("q", "k", "v"):
        m += [x for x in tensor(arg, a[arg], env.gpu) if not (arg == "q" and x.name == "one-row-short")]
    return m + [Mutation("v", "other-length", REFUSE, lambda t: t[:-1].contiguous()),
                Mutation("k", "three-heads", REFUSE, lambda t: t[:, :1].expand(-1, 3, -1).contiguous())]


def single_invoke(env: Env, a: dict):
    return attnforge.single_prefill(a["q"], a["k"], a["v"], causal=True, sm_scale=a["sm_scale"])


def merge_state_build(env: Env) -> dict:
    g = torch.Generator().manual_seed(9)
    return {f"{n}_{side}": _rand(g, (5, 4, 128) if n == "v" else (5, 4), torch.bfloat16 if n == "v" else torch.float32,
                                 env.device) for side in "ab" for n in "vs"}


def merge_state_mutations(a: dict, env: Env) -> list:
    m = []
    for arg in ("v_a", "v_b", "s_a", "s_b"):
        m += retag(tensor(arg, a[arg], env.gpu), SAME, *COPIED)
    m = retag(m, None, "float32") + [Mutation(arg, "bf16", REFUSE, lambda t: t.bfloat16()) for arg in ("s_a", "s_b")]
    return [x for x in m if not (x.arg.startswith("s") and x.name in ("dtype", "narrow-last"))]


def merge_state_invoke(env: Env, a: dict):
    return attnforge.merge_state(a["v_a"], a["s_a"], a["v_b"], a["s_b"])


def slots_build(env: Env) -> dict:
    g = torch.Generator().manual_seed(10)
    dev = env.device
    return {"k": _rand(g, (3, 2, 128), torch.bfloat16, dev), "v": _rand(g, (3, 2, 128), torch.bfloat16, dev),
            "slot_mapping": torch.tensor([5, -1, 7 * PAGE + 3], dtype=torch.int64, device=dev),
            "kv_cache": _rand(g, (8, 2, PAGE, 2, 128), torch.bfloat16, dev)}


def slots_mutations(a: dict, env: Env) -> list:
    m = tensor("k", a["k"], env.gpu) + tensor("v", a["v"], env.gpu)
    m += [x for x in tensor("kv_cache", a["kv_cache"], env.gpu) if x.name != "one-row-short"]
    m += [Mutation("slot_mapping", "float", REFUSE, lambda t: t.float()),
          Mutation("slot_mapping", "2d", REFUSE, lambda t: t[None]),
          Mutation("slot_mapping", "one-short", REFUSE, lambda t: t[:-1]),
          Mutation("slot_mapping", "int32", SAME, lambda t: t.int()),
          Mutation("slot_mapping", "list", REFUSE, lambda t: t.tolist())]
    if env.gpu:
        m.append(Mutation("slot_mapping", "cpu", REFUSE, lambda t: t.cpu()))
    return m


def slots_invoke(env: Env, a: dict):
    attnforge.append_kv_by_slots(a["k"], a["v"], a["slot_mapping"], a["kv_cache"])
    return a["kv_cache"]


def mla_append_build(env: Env) -> dict:
    a = mla_build(env)
    g, dev = torch.Generator().manual_seed(12), env.device
    a.update(ckv=_rand(g, (3, 512), torch.bfloat16, dev), kpe=_rand(g, (3, 64), torch.bfloat16, dev),
             batch_indices=torch.arange(3, dtype=torch.int32, device=dev),
             positions=torch.tensor([9, 36, 99], dtype=torch.int32, device=dev))
    a["kv_indices"] = torch.tensor(a["kv_indices"], device=dev)
    a["kv_indptr"] = torch.tensor(a["kv_indptr"], device=dev)
    return a


def mla_append_mutations(a: dict, env: Env) -> list:
    m = [x for arg in ("ckv", "kpe") for x in tensor(arg, a[arg], env.gpu)]
    m += [x for arg in ("ckv_cache", "kpe_cache") for x in tensor(arg, a[arg], env.gpu) if x.name != "one-row-short"]
    m += [Mutation("kpe_cache", "fewer-pages", REFUSE, lambda t: t[:-1])]
    for arg in ("batch_indices", "positions", "kv_indices", "kv_indptr"):
        m += [Mutation(arg, "float", REFUSE, lambda t: t.float()), Mutation(arg, "int64", SAME, lambda t: t.long())]
    return m


def mla_append_invoke(env: Env, a: dict):
    attnforge.append_paged_mla_kv_cache(a["ckv"], a["kpe"], a["batch_indices"], a["positions"], a["ckv_cache"],
                                        a["kpe_cache"], a["kv_indices"], a["kv_indptr"])
    return a["ckv_cache"], a["kpe_cache"]


def single_decode_build(env: Env) -> dict:
    g = torch.Generator().manual_seed(10)
    shapes = {"q": (8, 128), "k": (70, 2, 128), "v": (70, 2, 128)}
    return {**{n: _rand(g, s, torch.bfloat16, env.device) for n, s in shapes.items()}, "sm_scale": 0.1,
            "kv_layout": "NHD"}


def single_decode_mutations(a: dict, env: Env) -> list:
    m = scale("sm_scale", refuse_zero=False)
    for arg in ("q", "k", "v"):  # (one row short: q one head, refused by the group; k or v one key, by the other)
        m += tensor(arg, a[arg], env.gpu)
    return m + [Mutation("k", "three-heads", REFUSE, lambda t: t[:, :1].expand(-1, 3, -1).contiguous()),
                Mutation("kv_layout", "lower-case", REFUSE, lambda x: "nhd"),
                Mutation("kv_layout", "other-layout", REFUSE, lambda x: "HND")]  # (2 keys of 70 heads: no group)


@contextlib.contextmanager
def dense_decode_wrappers(env: Env):
    """attnforge.dense_decode's wrappers made as this environment makes wrappers (host-only on the CPU)."""
    from attnforge import dense_decode
    made = dense_decode.make_wrapper
    if not env.gpu:
        dense_decode.make_wrapper = lambda spec, device, batch, q_len=1: env.wrapper(
            BatchDecode, spec, max_batch_size=batch, max_num_pages=batch, max_q_len=q_len)
    try:
        yield
    finally:
        dense_decode.make_wrapper = made


def single_decode_invoke(env: Env, a: dict):
    with dense_decode_wrappers(env):
        return attnforge.single_decode(a["q"], a["k"], a["v"], kv_layout=a["kv_layout"], sm_scale=a["sm_scale"])


# -- attention() of one query a request on the decode kernels (ATTNFORGE_ATTENTION_DECODE=1) ----------------------
def one_query_build(env: Env) -> dict:
    a = attention_build(env)
    a["q"] = a["q"][:, :, :1].contiguous()
    a["attn_mask"] = None  # (a mask keeps a call on the prefill kernels: dense_decode.fits)
    return a


def one_query_mutations(a: dict, env: Env) -> list:
    m = [x for x in attention_mutations(attention_build(env), env) if x.arg != "attn_mask"]
    return m + [Mutation("k", "sliced-from-a-longer-cache", SAME, lambda t: torch.cat([t, t], 2)[:, :, :100]),
                Mutation("v", "sliced-from-a-longer-cache", SAME, lambda t: torch.cat([t, t], 2)[:, :, :100])]


def one_query_invoke(env: Env, a: dict):
    was = os.environ.get("ATTNFORGE_ATTENTION_DECODE")
    os.environ["ATTNFORGE_ATTENTION_DECODE"] = "1"
    try:
        with dense_decode_wrappers(env):
            return attention_invoke(env, a)
    finally:
        if was is None:
            os.environ.pop("ATTNFORGE_ATTENTION_DECODE")
        else:
            os.environ["ATTNFORGE_ATTENTION_DECODE"] = was


MORE_APIS = [Api("decode-lse", decode_lse_build, decode_lse_mutations, decode_lse_invoke),
             Api("decode-fp8", decode_fp8_build, decode_fp8_mutations, decode_fp8_invoke),
             Api("verify", verify_build, verify_mutations, verify_invoke),
             Api("mla-unified", mla_unified_build, mla_unified_mutations, mla_unified_invoke),
             Api("mla-block-table", mla_block_table_build, mla_block_table_mutations, mla_block_table_invoke),
             Api("prefill-block-table", prefill_block_table_build, prefill_block_table_mutations,
                 prefill_block_table_invoke),
             Api("cascade", cascade_build, cascade_mutations, cascade_invoke, cpu=False),
             Api("quest", quest_build, quest_mutations, quest_invoke, cpu=False),
             Api("quest-heads", quest_heads_build, quest_heads_mutations, quest_heads_invoke, cpu=False,
                 plan_kernels=("quest_expand_heads_kernel",), run_args=("q", "kv_cache", "out")),
             Api("single-prefill", single_build, single_mutations, single_invoke),
             Api("merge-state", merge_state_build, merge_state_mutations, merge_state_invoke),
             Api("append-slots", slots_build, slots_mutations, slots_invoke),
             Api("append-mla", mla_append_build, mla_append_mutations, mla_append_invoke),
             Api("attention-one-query", one_query_build, one_query_mutations, one_query_invoke),
             Api("single-decode", single_decode_build, single_decode_mutations, single_decode_invoke)]

APIS = CORE_APIS + MORE_APIS  # every API the fuzz calls
