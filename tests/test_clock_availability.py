"""--availability on the virtual clock (AD-PSGD, sim/async_engine.py; Prague and LSGD:
tests/test_clock_availability_groups.py): a node outside its
session neither computes nor gossips, an iteration cut by a session's end or a dropout loses its
step, and the share of time the nodes work is the share of time the process keeps them on."""

from __future__ import annotations

import pytest
import torch

from fedswarm.algorithms.decentralized.topology import make_topology
from fedswarm.availability import Availability, OnOff
from fedswarm.config import RunConfig
from fedswarm.errors import ConfigError
from fedswarm.sim.async_engine import ADPSGDSimulation
from fedswarm.store import Store
from fedswarm.timemodel import BUILTIN_PROFILES

WIFI = BUILTIN_PROFILES["edge-wifi"]  # 16 samples: 0.16 s a step; a 128-byte message: ~10 ms


def _sim(n: int, availability: Availability, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    steps: list[tuple[int, float, float]] = []
    exchanges: list[tuple[int, int, float, float]] = []

    def gradient(i, x_hat, k):  # only the timing matters here
        return torch.randn(4, generator=gen), 0.0

    sim = ADPSGDSimulation(torch.randn(n, 4, generator=gen), make_topology("ring", n), [WIFI] * n, gradient, lr=0.1,
                           samples_per_step=16, message_bytes=128, seed=seed, availability=availability,
                           on_step=lambda i, s, e: steps.append((i, s, e)),
                           on_average=lambda i, j, s, e: exchanges.append((i, j, s, e)))
    return sim, steps, exchanges


def _inside(windows: list[tuple[float, float]], s: float, e: float) -> bool:
    return any(ws <= s and e <= we for ws, we in windows)


def test_a_trace_keeps_a_peer_silent_outside_its_window():
    n = 6
    windows = {i: [(0.0, 1e9)] for i in range(n)}
    windows[1] = [(0.0, 5.0), (20.0, 30.0)]  # a passive node (ring: odd nodes are passive)
    windows[2] = [(3.0, 12.0)]  # an active one
    sim, steps, exchanges = _sim(n, Availability(n, trace=windows))
    sim.advance_to(50.0)
    for i, s, e in steps:
        assert _inside(windows[i], s, e), (i, s, e)
    for i, j, s, e in exchanges:
        assert _inside(windows[i], s, e) and _inside(windows[j], s, e), (i, j, s, e)
    mine = [(s, e) for i, s, e in steps if i == 1]
    assert any(e <= 5.0 for _, e in mine) and any(s >= 20.0 for s, _ in mine)  # it worked in both windows
    assert any(1 in (i, j) for i, j, _, _ in exchanges)
    assert {i for i, s, _ in steps if 5.0 < s < 20.0} >= {0, 2, 3, 4, 5}  # the others went on without it
    assert not [1 for i, s, _ in steps if i == 2 and (s < 3.0 or s >= 12.0)]
    # node 0 (active; passive neighbours 1 and 5) skips node 1 while it is off: every step of its there
    # averaged with node 5, none was a request to node 1 refused (a step alone)
    alone = [(s, e) for i, s, e in steps if i == 0 and 5.5 < s and e < 19.5]
    paired = [(s, e) for i, j, s, e in exchanges if i == 0 and 5.5 < s and e < 19.5]
    assert len(alone) > 40 and len(paired) >= len(alone) - 1 and all(j == 5 for i, j, s, _ in exchanges
                                                                     if i == 0 and 5.5 < s < 19.5)


def test_the_share_of_time_nodes_work_is_the_share_they_are_on():
    """Each node's time spent on steps it applied against the time its process keeps it on (an
    independent Availability with the same seed): all of the work inside, nearly all of the on time
    used (a step cut by a session's end is lost: 0.16 s of a 4 s session on average)."""
    n, horizon = 6, 600.0
    spec = [OnOff(4.0, 4.0)] * n
    sim, steps, _ = _sim(n, Availability(n, processes=spec, seed=7))
    sim.advance_to(horizon)
    oracle = Availability(n, processes=spec, seed=7)
    for i in range(n):
        busy = sum(e - s for j, s, e in steps if j == i)
        oracle.available(i, horizon)  # draws its windows up to the horizon
        on = sum(max(0.0, min(e, horizon) - s) for s, e in oracle._windows[i] if s < horizon)
        assert 0.8 * on <= busy <= on, (i, busy, on)
        assert 0.35 < on / horizon < 0.65  # the process keeps it on about half the time
    assert sim.lost_steps > 0


def test_a_dropout_loses_its_share_of_the_steps():
    n = 4
    sim, steps, _ = _sim(n, Availability(n, processes=[OnOff(1e9, 1.0, dropout=0.3)] * n, seed=3))
    sim.advance_to(300.0)
    attempts = sum(node.attempts for node in sim.nodes)
    assert attempts > 2000
    assert abs(sim.lost_steps / attempts - 0.3) < 0.04, sim.lost_steps / attempts
    assert len(steps) + sim.lost_steps >= attempts - n  # every attempt applied or lost (n still running)


def test_a_clock_run_with_availability_records_its_lost_steps(tmp_path):
    from fedswarm.sim.run import run_engine

    cfg = RunConfig(task="synthetic-logreg", strategy="adpsgd", clients=6, rounds=3, seed=0, local_steps=1,
                    devices="edge-wifi:6", availability="on=2,off=2,dropout=0.1")
    store = Store(tmp_path / "clock.db")
    rid = store.create_run(cfg.model_dump())
    assert run_engine(cfg, store=store, run_id=rid) == "finished"
    rounds = [r for r in store.rounds(rid) if r.round > 0]
    assert len(rounds) == 3 and sum(r.metrics["lost_steps"] for r in rounds) > 0


def test_the_clock_and_array_engines_refuse_what_they_do_not_run():
    from fedswarm.sim.engines import check_config

    with pytest.raises(ConfigError, match="^--quorum: run on --engine inprocess, flower, batched .*not on the clock"):
        check_config(RunConfig(strategy="adpsgd", clients=4, quorum=2))
    with pytest.raises(ConfigError, match="^--availability: run on --engine .*not on the array engine"):
        check_config(RunConfig(strategy="dpsgd", engine="array", clients=4, devices="edge-wifi:4",
                               availability="on=5,off=5"))
    for strategy, params in (("adpsgd", {}), ("prague", {}), ("lsgd", {"mode": "async"})):
        assert check_config(RunConfig(strategy=strategy, engine="clock", clients=4, devices="edge-wifi:4",
                                      params=params, availability="on=5,off=5")).name == "clock"
