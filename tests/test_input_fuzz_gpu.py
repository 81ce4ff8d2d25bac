"""The bad-input fuzz on a GPU (tests/input_fuzz.py): every mutation of each API's valid call, the device ones
(CPU tensors, CUDA index arrays) included. A refused input must raise a clear ValueError or TypeError before any
kernel launches; an accepted one must give bitwise the valid call's output. Each call is synchronised, so a
fault (a misaligned address, an illegal access) fails the mutation that caused it."""
import pytest
import torch

from attnforge.jit.loader import LoadedKernel
from input_fuzz import REFUSE, SAME, clear_refusal, outputs_equal
from input_fuzz_apis import Env
from input_fuzz_more_apis import APIS

pytestmark = pytest.mark.gpu


def launch_names(monkeypatch) -> list:
    """The names of the kernels launched from here on, in order (LoadedKernel.launch wrapped)."""
    names, real = [], LoadedKernel.launch

    def recording(kernel, *args, **kwargs):
        names.append(kernel.name)
        return real(kernel, *args, **kwargs)
    monkeypatch.setattr(LoadedKernel, "launch", recording)
    return names


def gpu_env() -> Env:
    return Env(True, torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None,
               lambda cls, spec, **kwargs: cls(spec, **kwargs))


def _cases():
    env = Env(True, torch.device("cpu"), None)  # (the mutations' list needs no GPU)
    return [(api, m) for api in APIS for m in api.mutations(api.build(env), env)]


CASES = _cases()


@pytest.mark.parametrize("api,mutation", CASES, ids=[f"{a.name}-{m.id}" for a, m in CASES])
def test_each_mutation_is_refused_clearly_or_computes_the_same(monkeypatch, api, mutation):
    env = gpu_env()
    launches = launch_names(monkeypatch)
    args = api.build(env)
    want = api.invoke(env, dict(args))
    torch.cuda.synchronize()
    assert launches
    launched = len(launches)
    bad = dict(api.build(env))  # fresh buffers (out, the appended cache)
    bad[mutation.arg] = mutation.change(bad[mutation.arg])
    try:
        got = api.invoke(env, bad)
    except Exception as err:  # noqa: BLE001 (the point: which exception, and what it says)
        assert mutation.kind != SAME, f"a SAME input was refused: {type(err).__name__}: {err}"
        problem = clear_refusal(err)
        assert problem is None, problem
        allowed = api.plan_kernels if mutation.arg in api.run_args else ()  # (a valid plan() ran before run())
        early = [name for name in launches[launched:] if name not in allowed]
        assert not early, f"kernels launched before the refusal: {early}"
        return
    torch.cuda.synchronize()
    assert mutation.kind != REFUSE, f"{mutation.id} was accepted"
    assert outputs_equal(got, want), f"{mutation.id} was accepted but computed something else"
