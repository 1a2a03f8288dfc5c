"""Every swarm algorithm trains over real loopback sockets (in-process peers, one thread
each): accuracy well above chance, no message refused, and each one's own invariant."""

from __future__ import annotations

import pytest
import torch
from fedswarm.algorithms.decentralized import elect_leader, leader_pull, merge_leader, weighted_merge

from tests.swarm_helpers import make_peers, run_all

ALGOS = {
    "dpsgd": {},
    "qgm": {},
    "adpsgd": {},
    "lsgd": {"mode": "single", "tau_global": 2, "c2": 0.5},
    "swarm_merge": {},
    "squarm": {"codec": "topk", "ratio": 0.1, "period": 1},
}


@pytest.mark.parametrize("algorithm", list(ALGOS))
def test_algorithm_trains_over_sockets(tmp_path, algorithm):
    # AD-PSGD's pairings depend on message timing; more rounds make its progress less dependent on it.
    rounds = 10 if algorithm == "adpsgd" else 6
    # AD-PSGD's passive peers (bipartite split: they never initiate) train without waiting on
    # anyone; unpaced, on a loaded machine they can finish before their partners and then
    # answer "busy" to every request (found by a 20x repeat: 2 of 20 runs had < 6 exchanges).
    # A round pace, as real devices have, keeps the two sides running at the same time.
    pace = {"min_round_s": 0.5} if algorithm == "adpsgd" else {}
    peers = make_peers(tmp_path, 4, algorithm=algorithm, task="digits-mlp", params=ALGOS[algorithm],
                       rounds=rounds, local_steps=10, lr=0.3, **pace)
    x0 = peers[0].x0.clone()
    out = run_all(peers)
    assert min(o["rounds_done"] for o in out) == rounds
    X = torch.stack([p.driver.model() for p in peers])
    node_average = X.mean(dim=0)
    # Mixing is what these algorithms add to local SGD: the peers' spread around their
    # average must be a small part of how far they travelled (with mixing off, as in local
    # SGD on these iid shards, the ratio is about 0.3; mixed, 0.07 or less).
    spread = (X - node_average).pow(2).sum(dim=1).mean() / (X - x0).pow(2).sum(dim=1).mean()
    assert spread < 0.15, float(spread)
    _, acc = peers[0].evaluate(node_average)
    # chance is 0.1. AD-PSGD's pairing schedule and LSGD's leader (lowest loss at pull time)
    # depend on message timing between processes, so their accuracy after 6 rounds varies more.
    assert acc > (0.6 if algorithm in ("adpsgd", "lsgd") else 0.75), acc
    assert all(not o["dropped"] or set(o["dropped"]) <= {"closed"} for o in out), [o["dropped"] for o in out]
    assert all(o["bytes_up"] > 0 for o in out)
    rows = [r for o in out for r in o["rows"]]
    if algorithm == "swarm_merge":
        # every round merged; after the last merge every peer holds the same model
        assert all(r["merged"] for r in rows)
        final = [p.driver.model() for p in peers]
        assert all(torch.equal(final[0], x) for x in final)
    if algorithm == "lsgd":
        assert sum(bool(r.get("pulled")) for r in rows) == 3 * 3  # 3 non-leaders pull at rounds 2, 4, 6
    if algorithm == "squarm":
        dpsgd_bytes = 4 * peers[0].d * 2 * 6  # full models to 2 neighbours for 6 rounds
        sq_bytes = [o["bytes_by_kind"]["sq"]["sent"] for o in out]  # requests and their acks
        assert max(sq_bytes) < dpsgd_bytes / 2, sq_bytes
    if algorithm == "adpsgd":
        assert sum(r.get("exchange") == "ok" for r in rows) >= 6


def test_swarm_only_math():
    assert elect_leader({"b": 0.5, "a": 0.5, "c": 0.7}) == "a"
    x, lead = torch.zeros(3), torch.ones(3)
    torch.testing.assert_close(leader_pull(x, lead, 0.25), torch.full((3,), 0.25))
    assert [merge_leader(["c", "a", "b"], r) for r in range(4)] == ["a", "b", "c", "a"]
    m = weighted_merge([torch.zeros(2), torch.ones(2)], [1, 3])
    torch.testing.assert_close(m, torch.full((2,), 0.75))
    with pytest.raises(ValueError):
        weighted_merge([torch.zeros(2)], [0.0])
