"""--availability on the virtual clock for Prague (sim/async_groups.py: the group all-reduce among
workers that are on) and LSGD's asynchronous mode (sim/async_leaders.py: only workers that are on
report to the leader servers): a worker outside its session neither computes nor exchanges, the share
of time the workers work is the share of time the process keeps them on, a run is deterministic for
a seed, and a worker off for whole rounds has rows with no steps and no bytes."""

from __future__ import annotations

import pytest
import torch

from fedswarm.algorithms.decentralized.leader import LSGD
from fedswarm.availability import Availability, OnOff
from fedswarm.config import RunConfig
from fedswarm.sim.async_groups import PragueSimulation
from fedswarm.sim.async_leaders import LSGDSimulation
from fedswarm.store import Store
from fedswarm.timemodel import BUILTIN_PROFILES

WIFI = BUILTIN_PROFILES["edge-wifi"]  # 16 samples: 0.16 s a step; a 128-byte message: ~10 ms


def _sim(kind: str, n: int, availability: Availability | None, seed: int = 0, group_size: int = 2):
    """A simulation of ``kind`` (prague, lsgd) on 4-parameter models; what it did, as
    ``work[i] = [(start, end, what)]``: its steps ("step") and exchanges (a reduce, a server)."""
    gen = torch.Generator().manual_seed(seed)
    work: dict[int, list[tuple[float, float, str]]] = {i: [] for i in range(n)}

    def gradient(i, x_hat, k):  # only the timing matters here
        return torch.randn(4, generator=gen), float(torch.rand(1, generator=gen))

    def step(i, s, e):
        work[i].append((s, e, "step"))

    x0 = torch.randn(n, 4, generator=gen)
    if kind == "prague":
        def reduce(group, s, e):
            for j in group:
                work[j].append((s, e, "reduce"))

        sim = PragueSimulation(x0, [WIFI] * n, gradient, lr=0.1, samples_per_step=16, message_bytes=128,
                               group_size=group_size, availability=availability, on_step=step, on_reduce=reduce)
    else:
        algo = LSGD(mode="async", groups=2, tau_local=2, tau_global=4)
        sim = LSGDSimulation(x0, [WIFI] * n, gradient, algo, lr=0.1, samples_per_step=16, message_bytes=128,
                             availability=availability, on_step=step,
                             on_exchange=lambda i, server, s, e: work[i].append((s, e, server)))
    return sim, work


def _inside(windows: list[tuple[float, float]], s: float, e: float) -> bool:
    return any(ws <= s and e <= we for ws, we in windows)


@pytest.mark.parametrize("kind", ["prague", "lsgd"])
def test_a_trace_keeps_a_worker_silent_outside_its_window(kind):
    """Worker 1 is on in [0, 5) and [20, 30), worker 2 in [3, 12): every step and every exchange of
    theirs lies inside a window, they worked in each, and the others went on while they were off
    (Prague with group_size = n: a group of every worker that is on, never waiting for one that is off)."""
    n = 4
    windows = {i: [(0.0, 1e9)] for i in range(n)}
    windows[1] = [(0.0, 5.0), (20.0, 30.0)]
    windows[2] = [(3.0, 12.0)]
    sim, work = _sim(kind, n, Availability(n, trace=windows), group_size=n)
    sim.advance_to(40.0)
    for i in range(n):
        assert work[i], i
        for s, e, what in work[i]:
            assert _inside(windows[i], s, e), (i, s, e, what)
    for s0, e0 in windows[1] + windows[2]:
        assert any(s0 <= s and e <= e0 for i in (1, 2) for s, e, what in work[i] if what == "step"
                   and _inside([(s0, e0)], s, e)), (s0, e0)
    exchanges = {what for i in (1, 2) for _, _, what in work[i] if what != "step"}
    assert exchanges, kind  # they exchanged while on (a reduce; their servers)
    for i in (0, 3):  # always on: working while 1 and 2 are both off, and in sync with nobody waiting
        mine = [(s, e) for s, e, what in work[i] if what == "step" and 12.5 < s and e < 19.5]
        assert len(mine) > 20, (i, len(mine))
    if kind == "prague":  # the groups while 1 and 2 were off: 0 and 3 alone, all of them when all were on
        groups = {g for g in sim.groups}
        assert (0, 3) in groups or (3, 0) in groups
        assert any(len(g) == n for g in groups)


@pytest.mark.parametrize("kind", ["prague", "lsgd"])
def test_the_share_of_time_workers_work_is_the_share_they_are_on(kind):
    """Each worker's time spent on applied steps and exchanges against the time an independent
    Availability with the same seed keeps it on: all of it inside, most of the on time used (a step cut
    by a session's end is lost, a Prague worker waits in the queue), and dropouts lose steps."""
    n, horizon = 4, 200.0
    spec = [OnOff(4.0, 4.0, dropout=0.05)] * n
    sim, work = _sim(kind, n, Availability(n, processes=spec, seed=7))
    sim.advance_to(horizon)
    oracle = Availability(n, processes=spec, seed=7)
    for i in range(n):
        oracle.available(i, horizon)  # draws its windows up to the horizon
        windows = [w for w in oracle._windows[i] if w[0] < horizon]
        busy = sum(e - s for s, e, _ in work[i] if e <= horizon)
        on = sum(min(e, horizon) - s for s, e in windows)
        assert all(_inside(windows, s, e) for s, e, _ in work[i]), i
        assert 0.7 * on <= busy <= on, (i, busy, on)
        assert 0.3 < on / horizon < 0.7
    assert sim.lost_steps > 0


@pytest.mark.parametrize("kind", ["prague", "lsgd"])
def test_a_simulation_is_deterministic_for_a_seed(kind):
    def trace(seed):
        sim, work = _sim(kind, 4, Availability(4, processes=[OnOff(3.0, 2.0, dropout=0.2)] * 4, seed=seed))
        sim.advance_to(30.0)
        return work, sim.lost_steps, sim.x.clone()

    a, b, c = trace(1), trace(1), trace(2)
    assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])
    assert a[0] != c[0]


@pytest.mark.parametrize("strategy,params", [("prague", {"group_size": 2}), ("lsgd", {"mode": "async"})])
def test_a_worker_off_for_whole_rounds_has_empty_rows(tmp_path, strategy, params):
    """A run on the clock engine with a trace: worker 1 (node id 2) is off from 1 s to 6 s; every
    round inside that span has its row with no steps and no bytes, the others train in it, and the
    rounds record lost_steps."""
    from fedswarm.sim.run import run_engine

    trace = tmp_path / "trace.csv"
    trace.write_text("node,start_s,end_s\n0,0,1e9\n1,0,1\n1,6,1e9\n2,0,1e9\n3,0,1e9\n")
    cfg = RunConfig(task="synthetic-logreg", strategy=strategy, engine="clock", clients=4, rounds=40, seed=0,
                    local_steps=1, batch_size=16, devices="edge-wifi:4", params=params, availability=str(trace),
                    eval_every=1000)
    store = Store(tmp_path / "clock.db")
    rid = store.create_run(cfg.model_dump())
    assert run_engine(cfg, store=store, run_id=rid) == "finished"
    rounds = {r.round: r for r in store.rounds(rid) if r.round > 0}
    rows = store.node_rounds(rid)
    inside = [k for k, r in rounds.items() if r.metrics["sim_clock_s"] - r.sim_time_s >= 1.0
              and r.metrics["sim_clock_s"] <= 6.0]
    assert len(inside) >= 5, [(k, r.metrics["sim_clock_s"]) for k, r in rounds.items()]
    for k in inside:
        mine = [r for r in rows if r.round == k and r.node_id.endswith(":2") or r.round == k and r.node_id == "2"]
        assert len(mine) == 1 and mine[0].num_examples == 0 and not mine[0].bytes_up, (k, mine)
        others = [r for r in rows if r.round == k and r not in mine]
        assert sum(r.num_examples for r in others) > 0
    after = [r for r in rows if r.round > 0 and rounds[r.round].metrics["sim_clock_s"] - rounds[r.round].sim_time_s
             > 7.0 and (r.node_id.endswith(":2") or r.node_id == "2")]
    assert any(r.num_examples > 0 for r in after)  # on again: it trains again
    assert all("lost_steps" in r.metrics for r in rounds.values())
