"""Simulated time on the batched engine with ``--devices`` alone (fedswarm/sim/batched_simtime.py):
every round's ``sim_time_s`` is the in-process engine's (its round timer, fedswarm/sim/simtime.py),
with the same models and node rows, and both are the time model's slowest sampled node
(an oracle from the rows' bytes, fedswarm/timemodel.py)."""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import pytest

from fedswarm.store import Store
from fedswarm.timemodel import BUILTIN_PROFILES, parse_devices, sync_round_time_s
from tests.test_batched import same_models_on_both_engines

#: 8 nodes, the last 2 stragglers (10x slower compute: 2 steps of 16 examples take 3.2 s simulated, an
#: edge-wifi node's 0.32 s). round_timeout is 2 s: a straggler outlasts it, and on the in-process engine
#: without the fleet options nothing times it out (the round waits for it), so neither does batched.
BASE = dict(task="synthetic-logreg", seed=1, lr=0.5, clients=8, rounds=3, local_steps=2, fraction=0.5,
            devices="edge-wifi:6,straggler:2", round_timeout=2.0)
CASES = {"fedavg": dict(policies={"straggler": {"local_steps": 4}}),  # the straggler's own steps: 6.4 s
         "topk": dict(strategy="compressed_fedavg", params={"codec": "topk", "codec_params": "ratio=0.1"})}


def _node_rows(tmp_path, engine: str) -> list[tuple]:
    store = Store(tmp_path / f"{engine}.db")
    try:
        rid = store.list_runs()[0].id
        return sorted((r.round, int(r.node_id), r.status, r.reason, r.bytes_up, r.bytes_down)
                      for r in store.node_rounds(rid))
    finally:
        store.close()


def _oracle(rows: list[tuple], kw: dict) -> dict[int, float]:
    """Each round's simulated seconds from its node rows: the time model's federated round over the
    nodes that replied (download + ``local_steps`` batches on the node's device + upload)."""
    profiles = [BUILTIN_PROFILES[name] for name in parse_devices(kw["devices"], kw["clients"])]
    by_round: dict[int, list[tuple]] = defaultdict(list)
    for rnd, node, status, _, up, down in rows:
        if status != "failed":
            by_round[rnd].append((node, up, down))
    batch = 16  # RunConfig's default batch size
    steps = {name: pol.get("local_steps", kw["local_steps"]) for name, pol in kw.get("policies", {}).items()}
    return {rnd: sync_round_time_s([profiles[n - 1] for n, _, _ in nodes],
                                   [steps.get(profiles[n - 1].name, kw["local_steps"]) * batch for n, _, _ in nodes],
                                   [d for _, _, d in nodes], [u for _, u, _ in nodes])
            for rnd, nodes in by_round.items()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_batched_round_time_is_the_inprocess_one(case, tmp_path, monkeypatch):
    kw = {**BASE, **CASES[case]}
    _, _, rounds = same_models_on_both_engines(kw, tmp_path, monkeypatch)  # the models, every round, to 1e-5
    ref, got = _node_rows(tmp_path, "inprocess"), _node_rows(tmp_path, "batched")
    # the same nodes kept, with the same statuses and reasons (bytes: the engines' messages differ by 2 bytes)
    assert [r[:4] for r in got] == [r[:4] for r in ref]
    assert all(abs(a[5] - b[5]) <= 4 and a[4] == b[4] for a, b in zip(ref, got))
    oracle = _oracle(ref, kw)
    stragglers = {7, 8}
    for rnd, (a, b) in enumerate(rounds, start=1):
        assert a["sim_time_s"] is not None and b["sim_time_s"] is not None, (rnd, a["sim_time_s"], b["sim_time_s"])
        assert math.isclose(a["sim_time_s"], b["sim_time_s"], rel_tol=1e-5), (rnd, a["sim_time_s"], b["sim_time_s"])
        assert math.isclose(b["sim_time_s"], oracle[rnd], rel_tol=1e-5), (rnd, b["sim_time_s"], oracle[rnd])
        assert a["num_clients"] == b["num_clients"] == 4
    # the case exercises a straggler outlasting round_timeout (kept: no simulated timeout without the fleet
    # options) and a round without one (an edge-wifi node's time)
    sampled = defaultdict(set)
    for rnd, node, status, *_ in ref:
        sampled[rnd].add((node, status))
    slow = [rnd for rnd, nodes in sampled.items() if any(n in stragglers for n, _ in nodes)]
    fast = [rnd for rnd in sampled if rnd not in slow]
    assert slow and fast, dict(sampled)
    assert all(rounds[r - 1][1]["sim_time_s"] > kw["round_timeout"] for r in slow)
    assert all(rounds[r - 1][1]["sim_time_s"] < kw["round_timeout"] for r in fast)
    assert all(status == "ok" for rnd in slow for n, status in sampled[rnd] if n in stragglers), dict(sampled)


def test_node_bytes_reads_a_cohort_as_a_dict():
    """node_bytes on a CohortBytes (a node given twice: the sum; a node absent: 0) against the dict it stands for."""
    from fedswarm.sim.batched_round import CohortBytes
    from fedswarm.sim.batched_simtime import node_bytes

    ids, values = np.array([5, 2, 9, 2, 40]), np.array([10, 3, 7, 4, 1])
    table = defaultdict(int)
    for i, v in zip(ids.tolist(), values.tolist()):
        table[i] += v
    ask = np.array([1, 2, 5, 9, 40, 41])
    assert node_bytes(CohortBytes(ids, values), ask).tolist() == [table.get(i, 0) for i in ask.tolist()] == \
        [0, 7, 10, 7, 1, 0]
    assert node_bytes(dict(table), ask).tolist() == [0, 7, 10, 7, 1, 0]
    assert node_bytes(CohortBytes(ids[:0], values[:0]), ask).tolist() == [0] * 6


def test_a_failed_node_is_left_out_of_the_round_time(tmp_path, monkeypatch):
    """The two stragglers' training data is poisoned (tests/test_batched_diverged.py): their 1-bit codec
    raises, their error replies fail them, and the in-process timer skips error replies: the round
    is the edge-wifi nodes' (under a second), on both engines."""
    from fedswarm.tasks import TASKS
    from fedswarm.tasks.staged import STAGED_TASKS
    from tests.test_batched_diverged import DIVERGING, POISONED, _poisoned

    monkeypatch.setitem(TASKS, "digits-cnn4-inf", _poisoned(STAGED_TASKS["digits-cnn4"]))
    kw = {**DIVERGING, "strategy": "onebit", "devices": "edge-wifi:6,straggler:2"}
    assert {p + 1 for p in POISONED} == {7, 8}  # the stragglers
    # 1-bit quantizes: a tie may go either way on the two engines (same_models_on_both_engines' ties)
    _, _, rounds = same_models_on_both_engines(kw, tmp_path, monkeypatch, ties=True)
    ref, got = _node_rows(tmp_path, "inprocess"), _node_rows(tmp_path, "batched")
    assert [r[:3] for r in got] == [r[:3] for r in ref]
    assert {(node, status) for _, node, status, *_ in ref if status != "ok"} == {(7, "failed"), (8, "failed")}
    oracle = _oracle(ref, kw)  # the nodes that did not fail
    for rnd, (a, b) in enumerate(rounds, start=1):
        assert a["nodes_failed"] == b["nodes_failed"] == 2
        assert math.isclose(a["sim_time_s"], b["sim_time_s"], rel_tol=1e-5), (rnd, a["sim_time_s"], b["sim_time_s"])
        assert math.isclose(b["sim_time_s"], oracle[rnd], rel_tol=1e-5) and b["sim_time_s"] < 1.0
