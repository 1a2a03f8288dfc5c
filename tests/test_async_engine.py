"""AD-PSGD on the virtual clock: stragglers in simulated time, atomic pairwise averaging,
and a real run recorded into the store."""

from __future__ import annotations

import pytest
import torch

from fedswarm.config import RunConfig
from fedswarm.sim.async_engine import ADPSGDSimulation, run_async
from fedswarm.timemodel import BUILTIN_PROFILES, compute_time_s
from fedswarm.store import Store
from fedswarm.algorithms.decentralized.topology import make_topology

torch.set_num_threads(1)

WIFI, SLOW = BUILTIN_PROFILES["edge-wifi"], BUILTIN_PROFILES["straggler"]


def _sim(n=8, straggler=None, lr=0.0, x0=None, d=16, seed=0, topology="ring"):
    gen = torch.Generator().manual_seed(seed)
    x0 = torch.randn(n, d, generator=gen) if x0 is None else x0
    profiles = [SLOW if i == straggler else WIFI for i in range(n)]

    def gradient(i, x_hat, k):  # a random gradient: only its timing matters here
        return torch.randn(d, generator=gen), 0.0

    return ADPSGDSimulation(x0, make_topology(topology, n), profiles, gradient, lr=lr, samples_per_step=16,
                            message_bytes=4 * d + 64, seed=seed)


@pytest.mark.parametrize("straggler", [0, 3])  # an active node, a passive node
def test_straggler_takes_ten_times_fewer_steps(straggler):
    sim = _sim(straggler=straggler)
    horizon = 200 * compute_time_s(WIFI, samples=16)
    sim.advance_to(horizon)
    steps = sim.steps()
    others = [s for i, s in enumerate(steps) if i != straggler]
    assert min(others) >= 180  # the fast nodes did not wait for it
    ratio = (sum(others) / len(others)) / steps[straggler]
    assert 9.0 <= ratio <= 11.0


def test_pairwise_averaging_keeps_the_sum_and_contracts():
    sim = _sim(lr=0.0)
    x0 = sim.x.clone().double()
    cd0 = (x0 - x0.mean(0)).pow(2).sum(1).mean()
    sim.advance(400)
    x = sim.x.double()
    torch.testing.assert_close(x.sum(0), x0.sum(0), atol=1e-5, rtol=0)
    assert (x - x.mean(0)).pow(2).sum(1).mean() < 1e-3 * cd0
    assert sim.averagings > 100


def test_averaging_is_atomic_and_the_clock_never_goes_back():
    sim = _sim(lr=0.1, straggler=5)
    dispatch, seen = sim._dispatch, []

    def checked(t, event):
        assert not seen or t >= seen[-1]
        seen.append(t)
        dispatch(t, event)
        if event[0] == "average":  # both endpoints hold the same model right after
            i, j = event[1], event[2]
            assert torch.equal(sim.x[i], sim.x[j])
            assert sim.active[i] and not sim.active[j]

    sim._dispatch = checked
    sim.advance(300)
    assert len(seen) > 300


def test_odd_ring_is_refused():
    with pytest.raises(ValueError, match="bipartite"):
        _sim(n=5)


def test_run_async_trains_and_records(tmp_path):
    cfg = RunConfig(strategy="adpsgd", clients=8, rounds=6, lr=0.3, batch_size=16, seed=1,
                    devices="straggler:1,edge-wifi")
    store = Store(tmp_path / "a.db")
    run_id = store.create_run(cfg.model_dump())
    assert run_async(cfg, store, run_id) == "finished"
    result = store.export_result(run_id)
    rows = result["rounds"]
    assert [r["round"] for r in rows] == list(range(7))
    assert rows[-1]["test_accuracy"] > rows[0]["test_accuracy"] + 0.1
    for r in rows[1:]:
        assert r["sim_time_s"] > 0 and r["consensus_distance"] >= 0 and r["p2p_bytes"] > 0
    clock = [r["sim_clock_s"] for r in rows[1:]]
    assert clock == sorted(clock)
    assert result["summary"]["sim_time_s"] == pytest.approx(clock[-1])
    steps = {}
    for nr in store.node_rounds(run_id):
        steps[nr.node_id] = steps.get(nr.node_id, 0) + nr.num_examples
    assert steps["1"] < min(v for k, v in steps.items() if k != "1")  # partition 0 is the straggler
