"""The bad-input fuzz on the CPU (tests/input_fuzz.py): every mutation of each API's valid call, with the launches
stubbed. A refused input must raise a clear ValueError or TypeError before any launch; a SAME one must launch as
the valid call does. (The GPU file compares the accepted calls' outputs, and adds the device mutations.)"""
import pytest
import torch

import attnforge
from attnforge import BatchDecode, BatchMLADecode, BatchPrefill, append, dense, prefill
from helpers import stub_host_prefill
from input_fuzz import REFUSE, SAME, clear_refusal
from input_fuzz_apis import Env
from input_fuzz_more_apis import APIS


class HostPlanned:
    """A host-only decode or MLA wrapper (HostOnlyUpload) whose run() reads host buffers."""

    def __init__(self, w):
        self.w = w
        w.pdl, w.launch_after_own_kernel = True, False
        w._partial_o, w._partial_lse = torch.zeros(1 << 16), torch.zeros(1 << 12)
        w._merge_count = torch.zeros(1 << 10, dtype=torch.int32)

    def plan(self, *args, **kwargs):
        self.w.plan(*args, **kwargs)
        self.w._upload.dev = torch.zeros(1 << 16, dtype=torch.int32)  # (the host-only upload has no device copy)

    def run(self, *args, **kwargs):
        return self.w.run(*args, **kwargs)

    def run_narrowed(self, *args, **kwargs):  # (attention()'s decode route)
        return self.w.run_narrowed(*args, **kwargs)


def cpu_wrapper(cls, spec, **kwargs):
    if cls in (BatchDecode, BatchMLADecode):
        return HostPlanned(cls.host_only(spec, **kwargs))
    assert cls is BatchPrefill and not kwargs
    return cls(spec, device="cpu")


@pytest.fixture
def env(monkeypatch):
    rec = stub_host_prefill(monkeypatch, lambda t, box: bytes(128))
    for owner, table in ((dense, "_CALLS"), (prefill, "_WRAPPERS"), (append, "_LAUNCHES")):
        monkeypatch.setattr(owner, table, {})  # (their entries hold an earlier test's stubbed libraries)
    return Env(False, torch.device("cpu"), cpu_wrapper), rec


CPU_CASES = [(api, m) for api in APIS if api.cpu
             for m in api.mutations(api.build(Env(False, torch.device("cpu"), None)), Env(False, None, None))]


@pytest.mark.parametrize("api,mutation", CPU_CASES, ids=[f"{a.name}-{m.id}" for a, m in CPU_CASES])
def test_each_mutation_is_refused_clearly_or_runs(env, api, mutation):
    env, rec = env
    args = api.build(env)
    api.invoke(env, dict(args))
    launched = len(rec.launches)
    assert launched > 0
    bad = dict(args)
    bad[mutation.arg] = mutation.change(args[mutation.arg])
    try:
        api.invoke(env, bad)
    except Exception as err:  # noqa: BLE001 (the point: which exception, and what it says)
        assert mutation.kind != SAME, f"a SAME input was refused: {type(err).__name__}: {err}"
        problem = clear_refusal(err)
        assert problem is None, problem
        assert len(rec.launches) == launched, "a kernel launched before the refusal"
        return
    assert mutation.kind != REFUSE, f"{mutation.id} was accepted"
    assert len(rec.launches) == 2 * launched  # the valid call's launches again


@pytest.mark.parametrize("api", [a for a in APIS if a.cpu], ids=lambda a: a.name)
@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_tensors_autograd_tracks_run_where_grad_mode_is_off(env, api, mode):
    """The requires-grad refusals come from grad mode, not the flag alone: an engine's step runs under no_grad or
    inference_mode, where a tracked input (a parameter, say) launches as the valid call does."""
    env, rec = env
    args = api.build(env)
    api.invoke(env, dict(args))
    launched = len(rec.launches)
    tracked = {k: v.detach().clone().requires_grad_() if isinstance(v, torch.Tensor) and v.dtype.is_floating_point
               else v for k, v in args.items()}
    assert any(isinstance(v, torch.Tensor) and v.requires_grad for v in tracked.values())
    with mode():
        api.invoke(env, tracked)
    assert len(rec.launches) == 2 * launched


def test_a_merge_given_out_and_another_out_dtype_is_refused(env):
    """merge_states(out=..., out_dtype=...) with two different dtypes wrote out's dtype and ignored out_dtype: now
    refused before the launch; the same dtype twice, or out alone, runs."""
    from input_fuzz_apis import merge_build
    env, rec = env
    a = merge_build(env)
    out = torch.empty(7, 4, 128, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"out_dtype: expected out's dtype torch.float32 \(or None\) when out is "
                                         r"given, got torch.bfloat16"):
        attnforge.merge_states(a["v"], a["s"], out=out, out_dtype=torch.bfloat16)
    assert not rec.launches
    attnforge.merge_states(a["v"], a["s"], out=out, out_dtype=torch.float32)
    attnforge.merge_states(a["v"], a["s"], out=out)
    assert len(rec.launches) == 2
