"""The public APIs the bad-input fuzz calls (tests/input_fuzz.py): for each, a valid call as a dict of named
arguments, its mutations, and how to invoke it in an Env (the CPU with launches stubbed, or a GPU)."""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import numpy as np
import torch
from torch.nn.attention.flex_attention import AuxRequest

import attnforge
from attnforge import AttentionSpec, BatchDecode, BatchMLADecode, BatchPrefill
from input_fuzz import EITHER, REFUSE, SAME, Mutation, decode_out, index_array, page_size, retag, scale, tensor


class Env(NamedTuple):
    gpu: bool
    device: torch.device
    wrapper: Callable[..., Any]  # (cls, spec, **constructor keywords) -> a wrapper that plans and runs here


class Api(NamedTuple):
    name: str
    build: Callable[[Env], dict]  # a valid call's arguments
    mutations: Callable[[dict, Env], list]  # of one argument at a time
    invoke: Callable[[Env, dict], Any]  # plan and run; returns the outputs
    cpu: bool = True  # runs on the CPU with the launches stubbed
    # kernels a valid plan() launches (planning on the device: QuestHeadDecode's table expansion), and the
    # arguments run() takes: a refusal of those may follow plan()'s launches, a refusal of plan()'s may not
    plan_kernels: tuple = ()
    run_args: tuple = ()


def _rand(g, shape, dtype, device):
    return torch.randn(shape, generator=g).to(dtype).to(device)


def _csr(lengths, page: int, num_pages: int, g) -> tuple:
    """A shuffled page table over exactly num_pages pages (its largest id is the cache's last page)."""
    pages = [-(-n // page) for n in lengths]
    assert sum(pages) == num_pages
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    indices = torch.randperm(num_pages, generator=g).numpy().astype(np.int32)
    last = np.array([n - (p - 1) * page for n, p in zip(lengths, pages)], dtype=np.int32)
    return indptr, indices, last


def _cache_forms(arg: str) -> list:
    """The (K, V) forms of a [P, 2, ...] cache: the pair is SAME, a list EITHER; a V that differs from K in its
    dtype or pages, three tensors, or one 4-D tensor are refused."""
    return [Mutation(arg, "pair", SAME, lambda c: (c[:, 0], c[:, 1])),
            Mutation(arg, "pair-list", EITHER, lambda c: [c[:, 0], c[:, 1]]),
            Mutation(arg, "pair-v-dtype", REFUSE, lambda c: (c[:, 0], c[:, 1].half())),
            Mutation(arg, "pair-v-fewer-pages", REFUSE, lambda c: (c[:, 0], c[:-1, 1])),
            Mutation(arg, "pair-k-fewer-pages", REFUSE, lambda c: (c[:-1, 0], c[:, 1])),
            Mutation(arg, "triple", REFUSE, lambda c: (c[:, 0], c[:, 1], c[:, 1])),
            Mutation(arg, "one-half", REFUSE, lambda c: c[:, 0])]


PLAN_SCALARS = ("page_size", "sm_scale", "k_scale", "v_scale")
LENGTHS, PAGE = (10, 37, 100), 16  # 1 + 3 + 7 pages: partial last pages
NUM_PAGES = sum(-(-n // PAGE) for n in LENGTHS)


def _plan_mutations(a: dict, env: Env, q_len: bool = True) -> list:
    m = index_array("kv_indptr", a["kv_indptr"], env.gpu) + index_array("kv_indices", a["kv_indices"], env.gpu)
    m += index_array("kv_last_page_len", a["kv_last_page_len"], env.gpu, bad_value=0)
    m += [Mutation("kv_last_page_len", "last=page+1", REFUSE, lambda x: np.append(np.asarray(x)[:-1], PAGE + 1)),
          Mutation("kv_indptr", "decreasing", REFUSE, lambda x: np.asarray(x)[[0, 2, 1, 3]]),
          Mutation("kv_indptr", "starts-at-1", REFUSE, lambda x: np.asarray(x) + 1)]
    m += page_size() + scale("k_scale") + scale("v_scale") + scale("sm_scale", refuse_zero=False)
    if q_len:
        m += [Mutation("q_len", v, REFUSE, lambda x, v=v: {"0": 0, "2": 2, "float": 1.0, "bool": True}[v])
              for v in ("0", "2", "float", "bool")]
    return m


def _plan_kwargs(a: dict) -> dict:
    return {k: a[k] for k in PLAN_SCALARS + ("q_len",) if k in a}


# -- BatchDecode ------------------------------------------------------------------------------------------
DECODE_SPEC = AttentionSpec(num_qo_heads=8, num_kv_heads=2)


def _paged_plan(g, sm_scale: float) -> dict:
    """A decode-like plan's arguments: LENGTHS over a shuffled table of NUM_PAGES pages, one token a request."""
    indptr, indices, last = _csr(LENGTHS, PAGE, NUM_PAGES, g)
    return {"kv_indptr": indptr, "kv_indices": indices, "kv_last_page_len": last, "page_size": PAGE,
            "sm_scale": sm_scale, "k_scale": 1.0, "v_scale": 1.0, "q_len": 1}


def _as_block_table(a: dict) -> dict:
    """A plan's CSR arrays as vLLM's form: per-request lengths and a block table whose unused slots hold -1."""
    indptr, indices = a.pop("kv_indptr"), a.pop("kv_indices")
    a.pop("kv_last_page_len")
    table = np.full((len(LENGTHS), 8), -1, dtype=np.int32)
    for b in range(len(LENGTHS)):
        table[b, :indptr[b + 1] - indptr[b]] = indices[indptr[b]:indptr[b + 1]]
    return {"seq_lens": np.array(LENGTHS, dtype=np.int32), "block_table": table, **a}


def decode_build(env: Env) -> dict:
    g = torch.Generator().manual_seed(0)
    return {**_paged_plan(g, 0.1), "q": _rand(g, (3, 8, 128), torch.bfloat16, env.device),
            "kv_cache": _rand(g, (NUM_PAGES, 2, PAGE, 2, 128), torch.bfloat16, env.device),
            "out": torch.full((3, 8, 128), float("nan"), dtype=torch.bfloat16, device=env.device)}


def decode_mutations(a: dict, env: Env) -> list:
    return (_plan_mutations(a, env) + tensor("q", a["q"], env.gpu) + tensor("kv_cache", a["kv_cache"], env.gpu) +
            _cache_forms("kv_cache") + decode_out("out", a["out"], env.gpu))


def decode_invoke(env: Env, a: dict):
    w = env.wrapper(BatchDecode, DECODE_SPEC)
    w.plan(a["kv_indptr"], a["kv_indices"], a["kv_last_page_len"], **_plan_kwargs(a))
    return w.run(a["q"], a["kv_cache"], out=a["out"])


# -- BatchDecode, vLLM's form: per-request lengths and a block table -------------------------------------
def block_table_build(env: Env) -> dict:
    return _as_block_table(decode_build(env))


def block_table_mutations(a: dict, env: Env) -> list:
    m = index_array("seq_lens", a["seq_lens"], env.gpu)
    m += [Mutation("block_table", "1d", REFUSE, lambda t: np.asarray(t).reshape(-1)),
          Mutation("block_table", "float", REFUSE, lambda t: np.asarray(t, np.float32)),
          Mutation("block_table", "one-row-short", REFUSE, lambda t: np.asarray(t)[:-1]),
          Mutation("block_table", "narrow", REFUSE, lambda t: np.asarray(t)[:, :6]),  # 7 pages needed
          Mutation("block_table", "negative-id", REFUSE, lambda t: _with(t, (2, 0), -1)),
          Mutation("block_table", "id-past-cache", REFUSE, lambda t: _with(t, (2, 0), NUM_PAGES)),
          Mutation("block_table", "list", SAME, lambda t: np.asarray(t).tolist()),
          Mutation("block_table", "int64", SAME, lambda t: np.asarray(t, np.int64)),
          Mutation("block_table", "fortran", SAME, lambda t: np.asfortranarray(t)),
          Mutation("block_table", "wider", SAME, lambda t: np.pad(np.asarray(t), ((0, 0), (0, 4)), constant_values=-7))]
    return m + tensor("q", a["q"], env.gpu)[:3]


def _with(t, at, value):
    b = np.array(t, dtype=np.int64)
    b[at] = value
    return b


def block_table_invoke(env: Env, a: dict):
    w = env.wrapper(BatchDecode, DECODE_SPEC)
    w.plan(seq_lens=a["seq_lens"], block_table=a["block_table"], **_plan_kwargs(a))
    return w.run(a["q"], a["kv_cache"], out=a["out"])


# -- BatchMLADecode ---------------------------------------------------------------------------------------
MLA_SPEC = AttentionSpec(family="mla_decode", num_qo_heads=16, num_kv_heads=1, head_dim_qk=576, head_dim_vo=512,
                         pipeline="normal")


def mla_build(env: Env) -> dict:
    g = torch.Generator().manual_seed(1)
    return {**_paged_plan(g, 0.07), "q_nope": _rand(g, (3, 16, 512), torch.bfloat16, env.device),
            "q_pe": _rand(g, (3, 16, 64), torch.bfloat16, env.device),
            "ckv_cache": _rand(g, (NUM_PAGES, PAGE, 512), torch.bfloat16, env.device),
            "kpe_cache": _rand(g, (NUM_PAGES, PAGE, 64), torch.bfloat16, env.device),
            "out": torch.full((3, 16, 512), float("nan"), dtype=torch.bfloat16, device=env.device)}


def mla_mutations(a: dict, env: Env) -> list:
    m = _plan_mutations(a, env)
    for arg in ("q_nope", "q_pe", "ckv_cache", "kpe_cache", "out"):
        m += tensor(arg, a[arg], env.gpu)
    m += [Mutation("kpe_cache", "none", REFUSE, lambda t: None)]  # the 512-wide latent alone is not a 576 cache
    return m


def mla_invoke(env: Env, a: dict):
    w = env.wrapper(BatchMLADecode, MLA_SPEC)
    w.plan(a["kv_indptr"], a["kv_indices"], a["kv_last_page_len"], **_plan_kwargs(a))
    return w.run(a["q_nope"], a["q_pe"], a["ckv_cache"], a["kpe_cache"], out=a["out"])


# -- BatchPrefill, paged and ragged -----------------------------------------------------------------------
PREFILL_SPEC = AttentionSpec(family="prefill", num_qo_heads=8, num_kv_heads=2, causal=True)
QO_LENGTHS = (4, 30, 70)


def prefill_build(env: Env) -> dict:
    g = torch.Generator().manual_seed(2)
    indptr, indices, last = _csr(LENGTHS, PAGE, NUM_PAGES, g)
    rows = sum(QO_LENGTHS)
    return {"qo_indptr": np.concatenate([[0], np.cumsum(QO_LENGTHS)]).astype(np.int32), "kv_indptr": indptr,
            "kv_indices": indices, "kv_last_page_len": last, "page_size": PAGE, "sm_scale": 0.1, "k_scale": 1.0,
            "v_scale": 1.0, "q": _rand(g, (rows, 8, 128), torch.bfloat16, env.device),
            "kv_cache": _rand(g, (NUM_PAGES, 2, PAGE, 2, 128), torch.bfloat16, env.device),
            "out": torch.full((rows, 8, 128), float("nan"), dtype=torch.bfloat16, device=env.device)}


def prefill_mutations(a: dict, env: Env) -> list:
    m = _plan_mutations(a, env, q_len=False) + index_array("qo_indptr", a["qo_indptr"], env.gpu)
    return m + tensor("q", a["q"], env.gpu) + tensor("kv_cache", a["kv_cache"], env.gpu) + \
        _cache_forms("kv_cache") + tensor("out", a["out"], env.gpu)


def prefill_invoke(env: Env, a: dict):
    w = env.wrapper(BatchPrefill, PREFILL_SPEC)
    w.plan(a["qo_indptr"], a["kv_indptr"], a["kv_indices"], a["kv_last_page_len"],
           **{k: a[k] for k in PLAN_SCALARS})
    return w.run(a["q"], a["kv_cache"], out=a["out"])


def ragged_build(env: Env) -> dict:
    g = torch.Generator().manual_seed(3)
    rows, keys = sum(QO_LENGTHS), sum(LENGTHS)
    return {"qo_indptr": np.concatenate([[0], np.cumsum(QO_LENGTHS)]).astype(np.int32),
            "kv_indptr": np.concatenate([[0], np.cumsum(LENGTHS)]).astype(np.int32), "sm_scale": 0.1,
            "q": _rand(g, (rows, 8, 128), torch.bfloat16, env.device),
            "k": _rand(g, (keys, 2, 128), torch.bfloat16, env.device),
            "v": _rand(g, (keys, 2, 128), torch.bfloat16, env.device)}


def ragged_mutations(a: dict, env: Env) -> list:
    m = index_array("qo_indptr", a["qo_indptr"], env.gpu) + index_array("kv_indptr", a["kv_indptr"], env.gpu)
    m += scale("sm_scale", refuse_zero=False)
    for arg in ("q", "k", "v"):
        m += tensor(arg, a[arg], env.gpu)
    return m


def ragged_invoke(env: Env, a: dict):
    w = env.wrapper(BatchPrefill, PREFILL_SPEC)
    w.plan(a["qo_indptr"], a["kv_indptr"], sm_scale=a["sm_scale"])
    return w.run(a["q"], (a["k"], a["v"]))


COPIED = ("strided-last", "misaligned", "odd-row-stride", "padded-rows")  # taken as a contiguous copy


# -- attention(), merge_states(), the appends ---------------------------------------------------------------
def attention_build(env: Env) -> dict:
    g = torch.Generator().manual_seed(4)
    return {"q": _rand(g, (2, 8, 40, 128), torch.bfloat16, env.device),
            "k": _rand(g, (2, 2, 100, 128), torch.bfloat16, env.device),
            "v": _rand(g, (2, 2, 100, 128), torch.bfloat16, env.device), "scale": 0.1, "is_causal": False,
            "attn_mask": torch.ones(2, 1, 1, 100, dtype=torch.bool, device=env.device),  # (SDPA's, keeping all)
            "dropout_p": 0.0, "score_mod": None, "mask_mod": None, "kernel_options": None,
            "return_aux": AuxRequest(lse=True), "enable_gqa": True}  # (Flex's arguments: attnforge/flex_args.py)


def attention_mutations(a: dict, env: Env) -> list:
    m = scale("scale", refuse_zero=False)
    for arg in ("q", "k", "v"):  # attention() copies what its kernel cannot read, as SDPA takes any layout
        m += retag(tensor(arg, a[arg], env.gpu), SAME, *COPIED)
        m.append(Mutation(arg, "flattened", REFUSE, lambda t: t.flatten()))  # (no [-2] dimension to read)
    m += [Mutation("q", "0-d", REFUSE, lambda t: t[0, 0, 0, 0]),
          Mutation("k", "heads-not-dividing", REFUSE, lambda t: t[:, :1].expand(-1, 3, -1, -1).contiguous()),
          Mutation("v", "other-length", REFUSE, lambda t: t[:, :, :-1].contiguous()),
          Mutation("is_causal", "int", REFUSE, lambda x: 1),
          Mutation("is_causal", "with-fewer-queries-than-keys", REFUSE, lambda x: True),  # (40 queries, 100 keys)
          Mutation("attn_mask", "int32", REFUSE, lambda t: t.int()),
          Mutation("attn_mask", "other-length", REFUSE, lambda t: t[..., :-1]),
          Mutation("attn_mask", "5-d", REFUSE, lambda t: t[None]),
          Mutation("attn_mask", "list", REFUSE, lambda t: t.tolist()),
          Mutation("attn_mask", "expanded", SAME, lambda t: t.expand(2, 8, 40, 100)),
          Mutation("attn_mask", "strided", SAME, lambda t: t.repeat(1, 1, 1, 2)[..., ::2]),
          Mutation("attn_mask", "float-requires-grad", REFUSE, lambda t: t.float().requires_grad_()),
          Mutation("dropout_p", "int-zero", SAME, lambda x: 0),
          Mutation("dropout_p", "training-value", REFUSE, lambda x: 0.1),
          Mutation("dropout_p", "nan", REFUSE, lambda x: float("nan")),
          Mutation("dropout_p", "tensor", REFUSE, lambda x: torch.tensor(0.0)),
          Mutation("score_mod", "float", REFUSE, lambda x: 0.5),
          Mutation("mask_mod", "string", REFUSE, lambda x: "causal"),
          Mutation("mask_mod", "bool-tensor", REFUSE, lambda x: torch.ones(40, 100, dtype=torch.bool)),
          Mutation("kernel_options", "dict", SAME, lambda x: {"BLOCK_M": 64, "num_stages": 2}),
          Mutation("kernel_options", "int", REFUSE, lambda x: 64),
          Mutation("enable_gqa", "string", REFUSE, lambda x: "yes"),
          Mutation("return_aux", "lse-as-int", REFUSE, lambda x: AuxRequest(lse=1)),
          Mutation("return_aux", "max-scores", REFUSE, lambda x: AuxRequest(lse=True, max_scores=True)),
          Mutation("return_aux", "plain-tuple", REFUSE, lambda x: (True, False))]
    if env.gpu:
        m.append(Mutation("attn_mask", "on-the-cpu", REFUSE, lambda t: t.cpu()))
    return m


def attention_invoke(env: Env, a: dict):
    out, aux = attnforge.attention(a["q"], a["k"], a["v"], a["score_mod"], a["mask_mod"], scale=a["scale"],
                                   enable_gqa=a["enable_gqa"], is_causal=a["is_causal"], attn_mask=a["attn_mask"],
                                   dropout_p=a["dropout_p"], kernel_options=a["kernel_options"],
                                   return_aux=a["return_aux"])
    return out, aux.lse


def merge_build(env: Env) -> dict:
    g = torch.Generator().manual_seed(5)
    return {"v": _rand(g, (7, 3, 4, 128), torch.bfloat16, env.device),
            "s": _rand(g, (7, 3, 4), torch.float32, env.device), "out_dtype": None}


def merge_mutations(a: dict, env: Env) -> list:
    m = retag(retag(tensor("v", a["v"], env.gpu), SAME, *COPIED), None, "dtype", "float32", "narrow-last")
    m += retag(retag(tensor("s", a["s"], env.gpu), SAME, *COPIED), None, "dtype", "float32", "narrow-last")
    return m + [Mutation("s", "bf16", REFUSE, lambda t: t.bfloat16()),
                Mutation("s", "one-state-short", REFUSE, lambda t: t[:, :-1]),
                Mutation("out_dtype", "int32", REFUSE, lambda x: torch.int32),  # (no merge writes integers)
                Mutation("out_dtype", "string", REFUSE, lambda x: "bf16"),
                Mutation("out_dtype", "bf16", SAME, lambda x: torch.bfloat16)]  # (v's own dtype)


def merge_invoke(env: Env, a: dict):
    return attnforge.merge_states(a["v"], a["s"], out_dtype=a["out_dtype"])


def append_build(env: Env) -> dict:
    g = torch.Generator().manual_seed(6)
    indptr, indices, last = _csr(LENGTHS, PAGE, NUM_PAGES, g)
    positions = np.array([n - 1 for n in LENGTHS], dtype=np.int32)  # one new token a request, at its end
    dev = env.device
    return {"k": _rand(g, (3, 2, 128), torch.bfloat16, dev), "v": _rand(g, (3, 2, 128), torch.bfloat16, dev),
            "batch_indices": torch.arange(3, dtype=torch.int32, device=dev),
            "positions": torch.tensor(positions, device=dev), "kv_indices": torch.tensor(indices, device=dev),
            "kv_indptr": torch.tensor(indptr, device=dev),
            "kv_cache": _rand(g, (NUM_PAGES, 2, PAGE, 2, 128), torch.bfloat16, dev)}


def append_mutations(a: dict, env: Env) -> list:
    m = tensor("k", a["k"], env.gpu) + tensor("v", a["v"], env.gpu)
    m += [x for x in tensor("kv_cache", a["kv_cache"], env.gpu) if x.name != "one-row-short"]
    for arg in ("batch_indices", "positions", "kv_indices", "kv_indptr"):
        m += [Mutation(arg, "float", REFUSE, lambda t: t.float()), Mutation(arg, "2d", REFUSE, lambda t: t[None]),
              Mutation(arg, "int64", SAME, lambda t: t.long()),
              Mutation(arg, "numpy", REFUSE, lambda t: t.cpu().numpy())]
        if env.gpu:
            m.append(Mutation(arg, "cpu", REFUSE, lambda t: t.cpu()))
    m += [Mutation("batch_indices", "one-short", REFUSE, lambda t: t[:-1]),
          Mutation("positions", "one-short", REFUSE, lambda t: t[:-1])]
    return m


def append_invoke(env: Env, a: dict):
    attnforge.append_paged_kv_cache(a["k"], a["v"], a["batch_indices"], a["positions"], a["kv_cache"], a["kv_indices"],
                                    a["kv_indptr"])
    return a["kv_cache"]  # (each call's arguments are built afresh)


CORE_APIS = [Api("decode", decode_build, decode_mutations, decode_invoke),
             Api("decode-block-table", block_table_build, block_table_mutations, block_table_invoke),
             Api("mla", mla_build, mla_mutations, mla_invoke),
             Api("prefill-paged", prefill_build, prefill_mutations, prefill_invoke),
             Api("prefill-ragged", ragged_build, ragged_mutations, ragged_invoke),
             Api("attention", attention_build, attention_mutations, attention_invoke),
             Api("merge-states", merge_build, merge_mutations, merge_invoke),
             Api("append", append_build, append_mutations, append_invoke)]
