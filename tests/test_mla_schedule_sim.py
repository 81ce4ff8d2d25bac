"""tools/mla_schedule_sim.py: the timing model of the wgmma MLA schedules runs every schedule to the
end, never beats the tensor cores' floor, and never gets faster when copies get slower."""
import importlib.util
import sys
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("mla_schedule_sim",
                                              Path(__file__).resolve().parents[1] / "tools" / "mla_schedule_sim.py")
sim = importlib.util.module_from_spec(spec)
sys.modules["mla_schedule_sim"] = sim  # dataclasses look their module up there
spec.loader.exec_module(sim)


@pytest.mark.parametrize("name", list(sim.SCHEDULES))
def test_every_schedule_runs_and_respects_the_tensor_core_floor(name):
    costs = sim.Costs()
    per_tile = sim.run(sim.SCHEDULES[name], 60, costs)
    assert per_tile >= costs.s + 2 * costs.pv_half  # S and both P.V halves share one tensor pipe


@pytest.mark.parametrize("name", list(sim.SCHEDULES))
def test_slower_copies_never_make_a_schedule_faster(name):
    times = [sim.run(sim.SCHEDULES[name], 60, sim.Costs(copy_latency=L)) for L in (500, 1500, 3000, 6000)]
    assert times == sorted(times)
    assert times[-1] > times[0]  # at 6000 cycles every order waits for its copies


def test_early_s_with_two_stages_loses_to_roles():
    """The ninth session's reason not to build it: S(t+2) issued early waits for a copy that could
    only start once P.V(t) freed the stage, at every calibrated copy latency."""
    for latency in (1500, 2500, 3200):
        costs = sim.Costs(copy_latency=latency)
        assert sim.run(sim.SCHEDULES["roles, early S"], 60, costs) > sim.run(sim.roles, 60, costs)
