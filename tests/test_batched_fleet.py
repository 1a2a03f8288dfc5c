"""Quorum rounds, over-selection, eligibility and availability on the batched engine
(fedswarm/sim/batched_fleet.py): the same sampled nodes, the same nodes kept, the same rows left
out with the same reasons, the same simulated clock and the same models as the in-process engine
(its fleet grid, fedswarm/server/fleet_grid.py) on the same seed."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedswarm.availability import Availability, OnOff
from fedswarm.config import RunConfig
from fedswarm.errors import ConfigError
from fedswarm.store import Store
from fedswarm.tasks import TASKS
from fedswarm.tasks.staged import STAGED_TASKS
from tests.test_batched import same_models_on_both_engines

TASK = "synthetic-logreg"

TOPK = dict(strategy="compressed_fedavg", params={"codec": "topk", "codec_params": "ratio=0.1"})

#: each a run both engines must agree on (the models every round to 1e-5, the node rows exactly)
CASES = {
    # over-selection, the quorum the nodes needed: the straggler (sampled in round 1 and 3) is late
    "over-select": dict(clients=10, rounds=3, local_steps=2, fraction=0.3, over_select=1.5,
                        devices="edge-wifi:8,straggler:2"),
    # a quorum of 3 of 5 sampled: equal finish times among the edge-wifi nodes (sampling order decides)
    "quorum-ties": dict(clients=12, rounds=3, local_steps=2, fraction=0.5, quorum=3, devices="edge-wifi:9,cpu:3"),
    # every class's rules on the machine's telemetry (FEDSWARM_FAKE_BATTERY=5): edge-wifi is left out
    "eligible": dict(clients=8, rounds=2, local_steps=1, fraction=0.5, devices="edge-wifi:4,straggler:4",
                     eligible="battery>=40", policies={"straggler": {"eligible": "battery<=10"}}),
    # sessions and mid-round dropouts: unavailable and dropped nodes, rounds that stall on a dropped node
    "availability": dict(clients=12, rounds=4, local_steps=2, fraction=0.5, devices="edge-wifi:8,straggler:4",
                         availability="on=6,off=4,dropout=0.2", round_timeout=30.0),
    # DP-FedAvg over the kept nodes: its noise and clipped mean calibrated on what the quorum kept
    "dp-over-select": dict(clients=10, rounds=3, local_steps=2, fraction=0.3, over_select=1.5,
                           devices="edge-wifi:8,straggler:2", dp="noise_multiplier=0.5,clip=0.3"),
    # all four at once, per-class processes with a diurnal pattern
    "all": dict(clients=16, rounds=4, local_steps=2, fraction=0.25, over_select=2.0, quorum=3,
                devices="edge-wifi:4,straggler:8,cpu:4", eligible="battery>=40", round_timeout=40.0,
                policies={"straggler": {"eligible": "battery<=10"}, "cpu": {"eligible": "battery<=10"}},
                availability="straggler:on=60,off=20,diurnal=0.5,period=100,dropout=0.1;cpu:on=30,off=10"),
    # compressed_fedavg (the codec runner), top-k with error feedback: every sampled node trains and its
    # residual moves, the late and dropped ones' too (their replies discarded), as the in-process nodes'
    "topk-quorum": dict(clients=12, rounds=4, local_steps=2, fraction=0.5, quorum=3, devices="edge-wifi:9,cpu:3",
                        **TOPK),
    "topk-over-select-availability": dict(clients=12, rounds=4, local_steps=2, fraction=0.3, over_select=1.5,
                                          devices="edge-wifi:8,straggler:4", round_timeout=30.0,
                                          availability="on=6,off=4,dropout=0.2", **TOPK),
    "topk-eligible": dict(clients=12, rounds=4, local_steps=2, fraction=0.5, quorum=2, devices="edge-wifi:6,cpu:6",
                          eligible="battery>=40", policies={"cpu": {"eligible": "battery<=10"}}, **TOPK),
    # the other strategies of the codec runner: 1-bit SGD (its quantization residuals move on every sampled node) ...
    "onebit-quorum": dict(clients=12, rounds=4, local_steps=2, fraction=0.5, quorum=3, devices="edge-wifi:9,cpu:3",
                          strategy="onebit"),
    "onebit-over-select-availability": dict(clients=12, rounds=4, local_steps=2, fraction=0.3, over_select=1.5,
                                            devices="edge-wifi:8,straggler:4", round_timeout=30.0,
                                            availability="on=6,off=4,dropout=0.2", strategy="onebit"),
    # ... the robust rules, over the kept replies only ...
    "median-over-select-availability": dict(clients=12, rounds=4, local_steps=2, fraction=0.3, over_select=1.5,
                                            devices="edge-wifi:8,straggler:4", round_timeout=30.0,
                                            availability="on=6,off=4,dropout=0.2", strategy="median"),
    # ... and under --byzantine: the attack on every reply that arrived (the fleet grid's inner grid attacks), the
    # quorum then keeping the first K of them
    "krum-signflip-quorum": dict(clients=12, rounds=4, local_steps=2, fraction=0.75, quorum=6,
                                 devices="edge-wifi:8,cpu:4", strategy="krum", byzantine=1, attack="signflip:scale=5"),
    "trimmed-alie-availability": dict(clients=16, rounds=4, local_steps=2, fraction=0.75, quorum=4,
                                      devices="edge-wifi:10,straggler:6", round_timeout=30.0,
                                      availability="on=20,off=5,dropout=0.1", strategy="trimmed_mean", byzantine=1,
                                      attack="alie"),
    # gTop-k: every sampled node's accumulator moves and takes the server's selection when next sampled
    "gtopk-quorum": dict(clients=12, rounds=4, local_steps=2, fraction=0.5, quorum=3, devices="edge-wifi:9,cpu:3",
                         strategy="gtopk", params={"density": 0.1}),
    "gtopk-over-select-availability": dict(clients=12, rounds=4, local_steps=2, fraction=0.3, over_select=1.5,
                                           devices="edge-wifi:8,straggler:4", round_timeout=30.0,
                                           availability="on=6,off=4,dropout=0.2", strategy="gtopk",
                                           params={"density": 0.1}),
    # FetchSGD: every sampled node's sketch state (momentum, error) moves in its Context
    "fetchsgd-quorum": dict(clients=12, rounds=4, local_steps=2, fraction=0.5, quorum=3, devices="edge-wifi:9,cpu:3",
                            strategy="fetchsgd"),
    "fetchsgd-over-select-availability": dict(clients=12, rounds=4, local_steps=2, fraction=0.3, over_select=1.5,
                                              devices="edge-wifi:8,straggler:4", round_timeout=30.0,
                                              availability="on=6,off=4,dropout=0.2", strategy="fetchsgd"),
    # Sketched-SGD and gs-SGD: the second exchange (the exact values at the candidates, asked of the kept nodes)
    # held to the quorum and the availability again, as the fleet grid holds every train exchange
    "sketched-quorum": dict(clients=8, rounds=3, local_steps=2, fraction=0.75, quorum=3, devices="edge-wifi:6,cpu:2",
                            strategy="sketched_sgd", params={"density": 0.1}),
    "sketched-availability": dict(clients=8, rounds=3, local_steps=2, fraction=0.75, devices="edge-wifi:5,straggler:3",
                                  round_timeout=30.0, availability="on=6,off=4,dropout=0.3", strategy="sketched_sgd",
                                  params={"density": 0.1}),
    "gs-over-select": dict(clients=8, rounds=3, local_steps=2, fraction=0.4, over_select=1.5,
                           devices="edge-wifi:6,straggler:2", strategy="gs_sgd", params={"density": 0.1}),
    "gs-quorum-availability": dict(clients=8, rounds=3, local_steps=2, fraction=0.75, quorum=3,
                                   devices="edge-wifi:5,straggler:3", round_timeout=30.0,
                                   availability="on=20,off=5,dropout=0.2", strategy="gs_sgd", params={"density": 0.1}),
    # PVT: each node's own variable subset; ProgFed: the stage schedule (its staged digits CNN), a stage boundary
    "pvt-quorum": dict(clients=12, rounds=3, local_steps=2, fraction=0.5, quorum=3, devices="edge-wifi:9,cpu:3",
                       strategy="pvt"),
    "pvt-over-select-availability": dict(clients=12, rounds=4, local_steps=2, fraction=0.3, over_select=1.5,
                                         devices="edge-wifi:8,straggler:4", round_timeout=30.0,
                                         availability="on=6,off=4,dropout=0.2", strategy="pvt"),
    "progfed-quorum-availability": dict(task="digits-cnn4", clients=8, rounds=2, local_steps=1, lr=0.1,
                                        fraction=0.75, quorum=3, devices="edge-wifi:6,straggler:2",
                                        round_timeout=30.0, availability="on=20,off=5,dropout=0.2",
                                        strategy="progfed", params={"stage_rounds": 1}),
    # two attackers that draw noise (gaussian) or random bytes, one of them kept and the other left out by the
    # quorum in a round: the attack's draws go to the attackers in the sampled order on both engines (before, the
    # in-process order followed a set of message ids, and the kept attacker's draw changed from run to run)
    "topk-gaussian2-quorum": dict(clients=8, rounds=2, local_steps=2, fraction=1.0, quorum=5,
                                  devices="edge-wifi:6,cpu:2", byzantine=2, attack="gaussian", **TOPK),
    "median-random2-quorum": dict(clients=8, rounds=2, local_steps=2, fraction=1.0, quorum=5,
                                  devices="edge-wifi:6,cpu:2", strategy="median", byzantine=2, attack="random"),
    "signum-random2-over-select": dict(seed=4, clients=8, rounds=2, local_steps=2, fraction=0.75, over_select=1.3,
                                       devices="straggler:4,edge-wifi:4", strategy="signum", byzantine=2,
                                       attack="random"),
    "gtopk-gaussian2-over-select": dict(seed=7, clients=8, rounds=2, local_steps=2, fraction=0.5, over_select=1.5,
                                        devices="edge-wifi:4,straggler:4", strategy="gtopk", params={"density": 0.1},
                                        byzantine=2, attack="gaussian"),
    # (gTop-k refuses a random payload: the draw each attacker got shows in its refusal's reason)
    "gtopk-random2-quorum": dict(clients=8, rounds=2, local_steps=2, fraction=1.0, quorum=5,
                                 devices="edge-wifi:6,cpu:2", strategy="gtopk", params={"density": 0.1}, byzantine=2,
                                 attack="random"),
}

#: what each case must exercise (its rows' statuses)
EXPECTED = {"over-select": {"late"}, "dp-over-select": {"late"}, "quorum-ties": {"late"},
            "eligible": {"ineligible"}, "availability": {"unavailable", "dropped"},
            "all": {"late", "ineligible", "unavailable"}, "topk-quorum": {"late"},
            "topk-over-select-availability": {"late", "unavailable", "dropped"},
            "topk-eligible": {"late", "ineligible"}, "onebit-quorum": {"late"},
            "onebit-over-select-availability": {"late", "unavailable", "dropped"},
            "median-over-select-availability": {"late", "unavailable", "dropped"},
            "krum-signflip-quorum": {"late"}, "trimmed-alie-availability": {"late", "unavailable", "dropped"},
            "gtopk-quorum": {"late"}, "gtopk-over-select-availability": {"late", "unavailable", "dropped"},
            "fetchsgd-quorum": {"late"}, "fetchsgd-over-select-availability": {"late", "unavailable", "dropped"},
            "sketched-quorum": {"late"}, "sketched-availability": {"unavailable", "dropped"},
            "gs-over-select": {"late"}, "gs-quorum-availability": {"late", "unavailable", "dropped"},
            "pvt-quorum": {"late"}, "pvt-over-select-availability": {"late", "unavailable", "dropped"},
            "progfed-quorum-availability": {"late", "unavailable"},
            "topk-gaussian2-quorum": {"late"}, "median-random2-quorum": {"late"},
            "signum-random2-over-select": {"late"}, "gtopk-gaussian2-over-select": {"late"},
            "gtopk-random2-quorum": {"late", "rejected"}}


def _rows(tmp_path, engine: str) -> list[tuple]:
    store = Store(tmp_path / f"{engine}.db")
    try:
        rid = store.list_runs()[0].id
        return sorted((r.round, int(r.node_id), r.status, r.reason) for r in store.node_rounds(rid))
    finally:
        store.close()


@pytest.mark.parametrize("case", sorted(CASES))
def test_batched_fleet_rounds_are_the_inprocess_ones(case, tmp_path, monkeypatch):
    monkeypatch.setenv("FEDSWARM_FAKE_BATTERY", "5")
    if CASES[case].get("strategy") == "progfed":  # its staged tasks
        for name, task in STAGED_TASKS.items():
            monkeypatch.setitem(TASKS, name, task)
    kw = {"task": TASK, "seed": 3, "lr": 0.5, **CASES[case]}
    _, _, rounds = same_models_on_both_engines(kw, tmp_path, monkeypatch)
    ref, got = _rows(tmp_path, "inprocess"), _rows(tmp_path, "batched")
    assert got == ref
    statuses = {status for _, _, status, _ in ref}
    assert EXPECTED[case] <= statuses, statuses  # the case exercises what it names
    if "availability" in CASES[case] and not {"quorum", "over_select"} & set(CASES[case]):
        # no quorum: a round that lost a node to a drop waited for it until round_timeout, whatever came after
        # in the round (Sketched-SGD's exact values: a second exchange that lost nobody)
        stalled = {rnd for rnd, _, status, _ in ref if status == "dropped"}
        for rnd, (a, _) in enumerate(rounds, start=1):
            assert rnd not in stalled or a["sim_time_s"] >= CASES[case]["round_timeout"], (rnd, a["sim_time_s"])
    if "strategy" in CASES[case]:  # a node left out (it trained, its residual moved) is kept in a later round
        left = {(node, rnd) for rnd, node, status, _ in ref if status in ("late", "dropped")}
        assert any(status == "ok" and any(n == node and r < rnd for n, r in left) for rnd, node, status, _ in ref)
    if CASES[case].get("byzantine"):  # the attack did happen, on a reply the quorum then kept or left out
        assert any(a.get("byzantine_nodes") for a, _ in rounds), rounds
    for a, b in rounds:  # the simulated clock (its reasons' times agree above) and what the round counted
        assert a["num_clients"] == b["num_clients"]
        assert a.get("byzantine_nodes") == b.get("byzantine_nodes")  # the same nodes attacked
        assert math.isclose(a["sim_time_s"], b["sim_time_s"], rel_tol=1e-5), (a["sim_time_s"], b["sim_time_s"])
        assert abs(a["bytes_down"] - b["bytes_down"]) <= 4 * 16  # the engines' messages differ by 2 bytes a node


@pytest.mark.parametrize("engine", ["inprocess", "batched"])
def test_a_node_that_never_finishes_is_late_in_every_quorum_round(engine, tmp_path):
    """A node a million times slower than the rest: with a quorum it is late every round it is
    sampled, and no round waits for it (simulated time)."""
    profiles = tmp_path / "asleep.toml"
    profiles.write_text("[straggler]\nspeed = 0.0001\n")  # a million times slower than edge-wifi
    from fedswarm.sim.run import run_engine

    cfg = RunConfig(task=TASK, engine=engine, clients=5, rounds=3, seed=0, local_steps=1, quorum=4,
                    devices="edge-wifi:4,straggler:1", profiles=str(profiles))
    store = Store(tmp_path / "asleep.db")
    rid = store.create_run(cfg.model_dump())
    assert run_engine(cfg, store=store, run_id=rid) == "finished"
    rows = store.node_rounds(rid)
    assert sorted((r.round, r.node_id) for r in rows if r.status == "late") == [(1, "5"), (2, "5"), (3, "5")]
    assert all("quorum of 4" in r.reason for r in rows if r.status == "late")
    rounds = [r for r in store.rounds(rid) if r.round > 0]
    assert all(r.num_clients == 4 and 0 < r.sim_time_s < 10.0 for r in rounds), [r.sim_time_s for r in rounds]


@pytest.mark.parametrize("engine", ["inprocess", "batched"])
def test_no_eligible_node_fails_the_round_saying_why(engine, tmp_path, monkeypatch):
    monkeypatch.setenv("FEDSWARM_FAKE_BATTERY", "5")
    from fedswarm.sim.run import run_engine

    cfg = RunConfig(task=TASK, engine=engine, clients=2, rounds=1, seed=0, local_steps=1, eligible="battery>=40",
                    round_timeout=0.5)
    store = Store(tmp_path / "none.db")
    rid = store.create_run(cfg.model_dump())
    with pytest.raises(RuntimeError, match="0 eligible node.*battery 5 fails battery>=40"):
        run_engine(cfg, store=store, run_id=rid)


def test_presence_is_availability_at_every_time():
    """The batched engine's cached on/off array against Availability.available, node by node."""
    from fedswarm.sim.batched_fleet import Presence

    procs = [OnOff(5.0, 3.0, dropout=0.1), OnOff(50.0, 1.0, diurnal=0.5, period=40.0), None, OnOff(1.0, 20.0)] * 5
    ref, fast = Availability(20, processes=procs, seed=4), Availability(20, processes=procs, seed=4)
    presence = Presence(fast, 20)
    for t in np.cumsum(np.random.default_rng(0).exponential(2.0, size=300)).tolist():
        assert presence.at(t).tolist() == [ref.available(pid, t) for pid in range(20)], t


def test_next_on_draws_only_as_far_as_it_needs_and_answers_the_same():
    """next_on against the windows drawn a year ahead at once (what it did before it drew them in steps)."""
    procs = [OnOff(100.0, 5000.0), OnOff(10.0, 200_000.0), OnOff(30.0, 30.0, diurnal=0.9)]
    for pid in range(len(procs)):
        for t in (0.0, 123.0, 9_999.5, 400_000.0):
            av, full = Availability(3, processes=procs, seed=1), Availability(3, processes=procs, seed=1)
            full._extend(pid, t + 365 * 86_400.0)
            starts = [s for s, e in full._windows[pid] if s > t and s <= t + 365 * 86_400.0]
            expect = t if full.available(pid, t) else (starts[0] if starts else None)
            assert av.next_on(pid, t) == expect
    assert Availability(1, processes=[OnOff(10.0, 1e9)], seed=0).next_on(0, 5e6, limit=10.0) is None


def test_the_batched_engine_refuses_the_fleet_options_it_does_not_run():
    from fedswarm.sim.engines import check_config

    assert check_config(RunConfig(task=TASK, engine="batched", quorum=3)).name == "batched"
    codec = RunConfig(task=TASK, engine="batched", strategy="compressed_fedavg", quorum=3)
    assert check_config(codec).name == "batched"
    for strategy in ("onebit", "median", "krum", "signum", "gtopk", "fetchsgd", "sketched_sgd", "gs_sgd", "pvt",
                     "progfed"):  # served
        task = "digits-cnn4" if strategy == "progfed" else TASK  # (a staged model)
        assert check_config(RunConfig(task=task, engine="batched", strategy=strategy, quorum=3)).name == "batched"
    byz = RunConfig(task=TASK, engine="batched", strategy="median", over_select=1.5, fraction=0.5, byzantine=1)
    assert check_config(byz).name == "batched"
    with pytest.raises(ConfigError, match="^--over-select with --byzantine on the batched engine: with the codec"):
        check_config(RunConfig(task=TASK, engine="batched", over_select=1.5, fraction=0.5, byzantine=1))
    with pytest.raises(ConfigError, match="^--eligible on the batched engine: in this process, not sharded"):
        check_config(RunConfig(task=TASK, engine="batched", eligible="charging", workers=2))


def test_a_second_exchange_in_the_round_is_held_to_the_fleet_again(tmp_path):
    """BatchedFleet.again (Sketched-SGD's and gs-SGD's exact values, asked of the kept nodes): a node whose
    session ends before its part of that exchange does loses the reply, with its row; the others come back
    first to finish first; the quorum it leaves short stalls the round (round_timeout simulated seconds).
    The equality cases above cannot reach this: a node kept in the first exchange passed the same dropout
    draw, and the second exchange's small messages finish before the first's."""
    from types import SimpleNamespace

    from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

    from fedswarm.sim.batched_fleet import BatchedFleet
    from fedswarm.sim.batched_round import make_reply

    trace = tmp_path / "trace.csv"
    trace.write_text("node,start_s,end_s\n0,0,100\n1,0,0.01\n2,0,100\n")  # node 2 goes off at t=0.01 s
    cfg = RunConfig(task=TASK, engine="batched", clients=3, quorum=3, devices="edge-lte:1,edge-wifi:2",
                    availability=str(trace), round_timeout=40.0)
    fleet = BatchedFleet(cfg, ConfigRecord({}), np.ones(3), None, None)
    fleet.take_sampling(SimpleNamespace(fraction_train=1.0, min_train_nodes=1, min_available_nodes=3))
    assert fleet.start(1)[0] == [1, 2, 3]
    asks = [Message(RecordDict({}), message_type="train.sketched_sgd", dst_node_id=n) for n in (1, 2, 3)]
    replies = [make_reply(m, RecordDict({"metrics": MetricRecord({"num-examples": 0, "phase": 2})})) for m in asks]
    # edge-wifi: 10 ms and 50 Mbit/s each way, so node 2's part ends at 0.02024 s; node 1 (edge-lte, 50 ms) last
    assert fleet.again([1, 2, 3], replies, [1000] * 3, [500] * 3) == [2, 0]
    row: dict = {}
    rows = fleet.close(row, [], lambda limit: [], {}, [])
    assert [(r["node_id"], r["status"], r["bytes_down"]) for r in rows] == [("2", "dropped", 1000)]
    assert "went offline mid-round at t=0 s" in rows[0]["reason"]
    assert row["sim_time_s"] == 40.0  # the quorum of 3 it left short waited for it
