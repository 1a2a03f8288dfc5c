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
    assert run_async(cfg, store=store, run_id=run_id) == "finished"
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


# --------------------------------------------------------------------------- LSGD async


def _lsgd_cfg(**kw) -> RunConfig:
    base = dict(strategy="lsgd", task="digits-mlp", clients=4, rounds=3, lr=0.1, batch_size=8, seed=2, local_steps=1,
                topology="complete", params={"mode": "async", "groups": 2, "tau_local": 2, "tau_global": 3})
    base.update(kw)
    return RunConfig(**base)


def _lsgd_sim(cfg, profiles, message_bytes=16):
    from fedswarm.algorithms.decentralized import make_algorithm
    from fedswarm.config import round_seed
    from fedswarm.sim.array_engine import ArraySimulation
    from fedswarm.sim.async_leaders import LSGDSimulation
    from fedswarm.algorithms.decentralized.steps import local_gradient

    arr = ArraySimulation(cfg)  # the same trainers and starting models

    def gradient(i, x, k):
        return local_gradient(arr.trainers[i], x, steps=1, batch_size=cfg.batch_size, lr=cfg.lr,
                              seed=round_seed(cfg.seed, k, i))

    sim = LSGDSimulation(arr.x0.repeat(cfg.clients, 1), profiles, gradient, make_algorithm("lsgd", **cfg.params),
                         lr=cfg.lr, samples_per_step=cfg.batch_size, message_bytes=message_bytes)
    return arr, sim


@pytest.mark.parametrize("taus", [(2, 1000), (1000, 3)])  # group servers only, the global server only
def test_lsgd_async_on_the_clock_replays_the_array_engine_when_every_worker_is_alike(taus):
    """Equal devices and transfers far shorter than a step: every worker finishes step k
    at the same instant and each server sees the reports in node order, which is the array
    engine's async LSGD (itself checked against a numpy oracle in test_gossip_extra). With
    both servers due in one step the orders differ by design (the clock: by arrival; a
    worker visiting two servers arrives at the second later), so each server is checked
    alone."""
    cfg = _lsgd_cfg(params={"mode": "async", "groups": 2, "tau_local": taus[0], "tau_global": taus[1]})
    arr, sim = _lsgd_sim(cfg, [BUILTIN_PROFILES["datacenter"]] * cfg.clients)
    for _ in range(cfg.rounds * 2):
        arr.step()
    while min(sim.steps()) < cfg.rounds * 2:
        sim._dispatch(*sim.clock.pop())
    assert sim.steps() == [cfg.rounds * 2] * cfg.clients  # nobody ran ahead
    assert sim.averagings > 0 and sim.leaders  # pulls happened, reports took over
    assert (arr.state.x - arr.state.x.mean(0)).abs().max() > 1e-6
    torch.testing.assert_close(sim.x, arr.state.x, atol=1e-6, rtol=0)


def test_lsgd_async_on_the_clock_lets_fast_workers_run_and_the_straggler_report_rarely():
    cfg = _lsgd_cfg()
    _, sim = _lsgd_sim(cfg, [WIFI, WIFI, WIFI, SLOW])
    sim.advance_to(40 * compute_time_s(WIFI, samples=cfg.batch_size))
    steps = sim.steps()
    assert min(steps[:3]) >= 30 and steps[3] <= max(steps[:3]) / 5, steps  # no barrier
    reports = [i for _, i in sim.leaders]
    assert reports and all(0 <= i < 4 for i in reports)


def test_lsgd_async_runs_on_the_clock_engine_and_records_rounds(tmp_path):
    from fedswarm.sim.run import run_engine

    cfg = _lsgd_cfg(engine="clock", devices="edge-wifi:3,straggler:1")
    store = Store(tmp_path / "l.db")
    run_id = store.create_run(cfg.model_dump())
    assert run_engine(cfg, store=store, run_id=run_id) == "finished"
    rounds = store.export_result(run_id)["rounds"]
    assert [r["round"] for r in rounds] == [0, 1, 2, 3]
    for r in rounds[1:]:
        assert r["sim_time_s"] > 0 and r["consensus_distance"] >= 0 and 0 <= r["test_accuracy"] <= 1
    assert sum(r["bytes_up"] for r in rounds) > 0 and sum(r["averagings"] for r in rounds[1:]) > 0
