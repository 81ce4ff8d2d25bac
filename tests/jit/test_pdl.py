"""Programmatic dependent launch (attnforge/jit/loader.py, wait_for_prior_grid in common.cuh): a kernel
launched with PDL may run while the previous kernel in the stream finishes, so it must wait for that
grid before it reads anything that grid writes. CPU: the launch configuration, the refusal of kernels
that do not wait, and, for every kernel that may be launched so, that it reads only its list of
buffers before the wait (ones its predecessor never writes) and writes nothing; before sm_90 a pdl=True
launch is an ordinary one."""
import ctypes
import dataclasses
import re
from pathlib import Path

import pytest
import torch

from attnforge import AttentionSpec
from attnforge.jit import loader
from attnforge.kernels.decode import DecodeKernel
from attnforge.kernels.mla import MLADecodeKernel
from attnforge.kernels.quest import QuestScoreKernel
from helpers import count_calls


def test_launch_config_allows_programmatic_serialization():
    config = loader.pdl_launch_config((3, 2, 1), (128, 1, 1), 4096, 0)
    assert (config.gridDimX, config.gridDimY, config.blockDimX, config.sharedMemBytes) == (3, 2, 128, 4096)
    assert config.numAttrs == 1
    attr = config.attrs[0]
    assert attr.id == loader.driver().CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert attr.value.programmaticStreamSerializationAllowed == 1


def test_pdl_launch_of_a_kernel_that_does_not_wait_is_refused():
    k = loader.LoadedKernel("lib", "batch_prefill_kernel", function=None)
    with pytest.raises(ValueError, match="waits for the prior grid"):
        k.launch((1,), (32,), params=None, pdl=True)  # refused before any driver call


def _sources():
    mla = AttentionSpec(family="mla_decode", num_qo_heads=16, num_kv_heads=1, head_dim_qk=576, head_dim_vo=512)
    # (MLA: the transposed wgmma kernel with reads_before_wait, whose copier resolves its first tiles' rows
    # before the wait: the default kernel's reads and more)
    return [DecodeKernel(AttentionSpec()).module().source,
            MLADecodeKernel(dataclasses.replace(mla, pipeline="transposed"), backend="wgmma",
                            reads_before_wait=True).module().source,
            QuestScoreKernel("bf16", "fp8", 128, 8, 4).module().source]


# What each PDL kernel may read before its wait: buffers its predecessor in the stream never writes
# (plan()'s copies, the queries, the Quest index), as params fields and helpers given the whole params.
# The predecessors: quest_qsplit_kernel writes P / N, quest_score_kernel the scores,
# quest_select_kernel the decode page table (kv_indices), mla_decode_kernel the partial states; decode's
# may be any kernel (the queries' projection, the cache append).
READ_BEFORE_WAIT = {
    # decode runs after any kernel with BatchDecode(pdl=True): only plan()'s copies before the wait
    "batch_decode_kernel": {"stream_prefix", "kv_begin", "kv_len", "num_kv_heads", "meta", "kv_indptr"},
    # MLA decode after any kernel with BatchMLADecode(pdl=True): only plan()'s copies before the wait
    "mla_decode_kernel": {"stream_prefix", "kv_begin", "kv_len", "meta", "num_row_blocks", "side_blocks",
                          # the copier's first tiles' rows, from plan()'s page table (no kernel of a step writes it)
                          "kv_indptr", "kv_indices", "resolve_copy_rows"},
    # decode's merge launch waits first (its rows' chunks come from the decode kernel's partial states)
    "batch_decode_merge_kernel": set(),
    # the merges after MLA decode: their rows' split items, from plan()'s copies
    "mla_merge_kernel": {"merge_ahead"},
    "mla_merge_one_wave_kernel": {"merge_ahead"},
    "quest_score_kernel": {"meta", "kv_indptr", "kv_indices", "load_slice"},  # load_slice: kmin / kmax
    "quest_select_kernel": {"meta", "kv_indptr", "sel_indptr", "kv_indices"},
}


def _body_before_wait(kernel: str) -> str:
    bodies = [m for src in _sources() for m in re.finditer(rf'extern "C" __global__[^{{]*\b{kernel}\(', src)]
    assert len(bodies) == 1, f"{kernel}: defined {len(bodies)} times in the rendered modules"
    src = bodies[0].string[bodies[0].end():]
    assert "wait_for_prior_grid()" in src, f"{kernel} never waits for the prior grid"
    return src[:src.index("wait_for_prior_grid()")]


def test_every_pdl_kernel_has_a_read_list():
    assert set(READ_BEFORE_WAIT) == set(loader.PDL_KERNELS)


@pytest.mark.parametrize("kernel", sorted(loader.PDL_KERNELS))
def test_every_pdl_kernel_reads_only_what_its_predecessor_never_writes_before_waiting(kernel):
    before = re.sub(r"//[^\n]*", "", _body_before_wait(kernel))  # comments name fields too
    fields = set(re.findall(r"\bp\.(\w+)", before))
    helpers = set(re.findall(r"\b(\w+)\(p\s*[,)]", before))  # the whole params passed on
    assert fields | helpers <= READ_BEFORE_WAIT[kernel], \
        f"{kernel} reads {sorted((fields | helpers) - READ_BEFORE_WAIT[kernel])} before wait_for_prior_grid()"
    assert not re.search(r"\bp\.\w+(\[[^]]*\])?\s*=[^=]", before), f"{kernel} writes before its wait"


def test_decode_reads_its_queries_only_after_the_wait():
    assert "p.q)" not in _body_before_wait("batch_decode_kernel")  # (an earlier kernel of the step writes q)


@pytest.mark.parametrize("kernel", ["mla_merge_kernel", "mla_merge_one_wave_kernel"])
def test_the_mla_merges_find_their_rows_before_the_wait(kernel):
    # the meta and each row's split item (plan()'s copies) are read under the decode grid's tail, so after the
    # wait only the partial states are read (h16 B1 L131072 -3.7% against reading them after it)
    before = _body_before_wait(kernel)
    assert "merge_ahead(p)" in before and "merge_row" not in before


def test_the_read_list_check_catches_a_read_of_the_predecessors_output():
    # the decode kernel's page-table read sits after its wait; read before it, the check must object
    before = _body_before_wait("batch_decode_kernel") + "__ldg(p.kv_indices + 3);"
    fields = set(re.findall(r"\bp\.(\w+)", before))
    assert "kv_indices" in fields - READ_BEFORE_WAIT["batch_decode_kernel"]


# What each PDL kernel reads after its wait that its predecessor writes, and where: those loads must be
# coherent (load_after_wait or a plain load), never __ldg's ld.global.nc, which ptxas may issue ahead of
# the wait (it did for decode's queries: common.cuh, load_after_wait). Regions are a struct or function
# of a rendered module or header, found by its opening text; fields are the params read there.
HEADERS = Path(__file__).resolve().parents[2] / "csrc_include" / "attnforge"
READ_AFTER_WAIT = {
    "batch_decode_kernel": [("decode", "struct QStage {"), ("paged_kv.cuh", "struct PagedKV {"),
                            ("kv_tile.cuh", None)],  # the queries, the page table (Quest's select)
    "batch_decode_merge_kernel": [("decode", "batch_decode_merge_kernel("), ("common.cuh", "void load_floats(")],
    "mla_decode_kernel": [("mla", "void load_q(")],  # the queries (its page table is plan()'s copy)
    "mla_merge_kernel": [("mla", "void merge_row("), ("common.cuh", "void load_floats(")],  # partial states
    "mla_merge_one_wave_kernel": [("mla", "void merge_row("), ("common.cuh", "void load_floats(")],
    "quest_score_kernel": [("quest", "struct SlotQuery {"), ("quest-int4", "struct SlotQuery {")],  # P / N
    "quest_select_kernel": [("quest", "quest_select_kernel(")],  # the scores
}
PREDECESSOR_FIELDS = {"q", "kv_indices", "page_ids", "partial_o", "partial_lse", "q_pos", "q_neg", "q_scale", "scores"}


def _regions(where: str, opening):
    src = dict(zip(("decode", "mla", "quest"), _sources())).get(where)
    if where == "quest-int4":  # the default summaries' scoring (int8 P / N and their scales)
        src = QuestScoreKernel("bf16", "int4", 128, 8, 4).module().source
    src = (HEADERS / where).read_text() if src is None else src
    if opening is None:
        return [src]
    out = [src[a:b] for a, b in region_spans(src, opening)]
    assert out, f"{opening!r} not found in {where}"
    return out


def region_spans(src: str, opening: str) -> list[tuple[int, int]]:
    """(start, end) offsets of each struct or function of `src` that begins with `opening`: from the
    opening text to its matching closing brace."""
    spans = []
    for m in re.finditer(re.escape(opening), src):
        depth, i = 0, src.index("{", m.start())
        while True:
            depth += {"{": 1, "}": -1}.get(src[i], 0)
            if depth == 0:
                break
            i += 1
        spans.append((m.start(), i + 1))
    return spans


def _ldg_reads_of_predecessor_output(text: str, whole_region: bool):
    text = re.sub(r"//[^\n]*", "", text)
    calls = re.findall(r"__ldg\(([^;]*)", text)
    return calls if whole_region else [c for c in calls if PREDECESSOR_FIELDS & set(re.findall(r"\w+", c))]


@pytest.mark.parametrize("kernel", sorted(loader.PDL_KERNELS))
def test_every_pdl_kernel_reads_its_predecessors_output_coherently(kernel):
    assert set(READ_AFTER_WAIT) == set(loader.PDL_KERNELS)
    for where, opening in READ_AFTER_WAIT[kernel]:
        for region in _regions(where, opening):  # a named region reads only such data: no __ldg at all
            bad = _ldg_reads_of_predecessor_output(region, whole_region=opening is not None)
            assert not bad, f"{kernel}: {where} {opening or ''} reads its predecessor's output through __ldg: {bad}"


def test_the_coherence_check_catches_an_ldg_of_the_predecessors_output():
    region = _regions("decode", "struct QStage {")[0]
    assert not _ldg_reads_of_predecessor_output(region, True)
    assert _ldg_reads_of_predecessor_output(region.replace("load_after_wait(src)", "__ldg(src)"), True)
    assert _ldg_reads_of_predecessor_output("x = __ldg(kv.page_ids + slot);", False)
    assert not _ldg_reads_of_predecessor_output("x = __ldg(p.stream_prefix + r);", False)


class _RecordingDriver:
    """The real cuda-python driver module, but launches are recorded instead of made (no GPU here)."""

    def __init__(self, real):
        self.real, self.calls = real, []

    def __getattr__(self, name):
        return getattr(self.real, name)

    def cuLaunchKernel(self, *args):
        self.calls.append("cuLaunchKernel")
        return (self.real.CUresult.CUDA_SUCCESS,)

    def cuLaunchKernelEx(self, *args):
        self.calls.append("cuLaunchKernelEx")
        return (self.real.CUresult.CUDA_SUCCESS,)


@pytest.mark.parametrize("major,expected", [(8, "cuLaunchKernel"), (9, "cuLaunchKernelEx"), (10, "cuLaunchKernelEx")])
def test_pdl_launch_is_an_ordinary_one_before_sm90(monkeypatch, major, expected):
    fake = _RecordingDriver(loader.driver())
    monkeypatch.setattr(loader, "driver", lambda: fake)
    monkeypatch.setattr(loader, "pdl_supported", lambda device_index=None: major >= 9)
    k = loader.LoadedKernel("lib", "quest_select_kernel", function=None)
    k.launch((4,), (128,), ctypes.c_int(0), stream=0, pdl=True)
    k.launch((4,), (128,), ctypes.c_int(0), stream=0)  # without pdl: always the ordinary call
    assert fake.calls == [expected, "cuLaunchKernel"]


def test_a_kernel_asks_for_pdl_support_once_and_builds_no_error_text_on_success(monkeypatch):
    fake = _RecordingDriver(loader.driver())
    monkeypatch.setattr(loader, "driver", lambda: fake)
    monkeypatch.setattr(loader, "pdl_supported", lambda device_index=None: True)  # (sm_90: no GPU here)
    asked = count_calls(monkeypatch, loader, "pdl_supported")
    texts = []
    real_check = loader.check
    monkeypatch.setattr(loader, "check", lambda result, call: texts.append(call) or real_check(result, call))
    k = loader.LoadedKernel("lib", "quest_select_kernel", function=None)
    for pdl in (True, True, False, True):
        k.launch((4,), (128,), ctypes.c_int(0), stream=0, pdl=pdl)
    assert asked["n"] == 1 and fake.calls == ["cuLaunchKernelEx"] * 2 + ["cuLaunchKernel", "cuLaunchKernelEx"]
    assert texts == []  # (check() and its message only for a failed launch: test_a_failed_launch_names_...)
    other = loader.LoadedKernel("lib", "quest_score_kernel", function=None)
    other.launch((4,), (128,), ctypes.c_int(0), stream=0, pdl=True)
    assert asked["n"] == 2  # (each kernel asks for its own device)


def test_pdl_support_follows_the_compute_capability(monkeypatch):
    loader._capability_major.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: {0: (8, 0), 1: (9, 0)}[index])
    try:
        assert not loader.pdl_supported(0) and loader.pdl_supported(1)
    finally:
        loader._capability_major.cache_clear()


def test_launch_configs_are_reused_per_shape_and_stream():
    k = loader.LoadedKernel("lib", "batch_decode_kernel", None)
    a = k._pdl_config((3, 1, 1), (128, 1, 1), 4096, 0)
    assert k._pdl_config((3, 1, 1), (128, 1, 1), 4096, 0) is a
    b = k._pdl_config((4, 1, 1), (128, 1, 1), 4096, 0)
    assert b is not a and (b.gridDimX, a.gridDimX) == (4, 3)
    for n in range(100):  # the table stays small
        k._pdl_config((n + 5, 1, 1), (128, 1, 1), 0, 0)
    assert len(k._pdl_configs) <= 64


class _FailingDriver(_RecordingDriver):
    """Every launch fails with CUDA_ERROR_INVALID_VALUE (the error's name and text without a GPU)."""

    def cuLaunchKernel(self, *args):
        return (self.real.CUresult.CUDA_ERROR_INVALID_VALUE,)

    cuLaunchKernelEx = cuLaunchKernel

    def cuGetErrorName(self, err):
        return (self.real.CUresult.CUDA_SUCCESS, b"CUDA_ERROR_INVALID_VALUE")

    def cuGetErrorString(self, err):
        return (self.real.CUresult.CUDA_SUCCESS, b"invalid argument")


@pytest.mark.parametrize("pdl", [False, True])
def test_a_failed_launch_names_the_kernel_and_its_shape(monkeypatch, pdl):
    fake = _FailingDriver(loader.driver())
    monkeypatch.setattr(loader, "driver", lambda: fake)
    monkeypatch.setattr(loader, "pdl_supported", lambda device_index=None: True)
    k = loader.LoadedKernel("lib", "quest_select_kernel", function=None)
    call = "cuLaunchKernelEx" if pdl else "cuLaunchKernel"
    with pytest.raises(loader.CudaDriverError, match=rf"{call}\(quest_select_kernel, grid=\(4, 1, 1\), block="
                                                     r"\(128, 1, 1\), smem=0.*CUDA_ERROR_INVALID_VALUE: invalid arg"):
        k.launch((4,), (128,), ctypes.c_int(0), stream=0, pdl=pdl)
