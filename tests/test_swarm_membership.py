"""Membership: gossip merge, failure detection, tombstones, rejoin, same topology for all."""

from __future__ import annotations

import time

from fedswarm.swarm.net.inbox import Inbox
from fedswarm.swarm.net.membership import Membership


def _entry(pid, inc=1, hb=1, **info):
    return {"id": pid, "addr": f"127.0.0.1:{1000 + len(pid)}", "inc": inc, "hb": hb, "info": info}


def test_merge_keeps_the_newest_and_ignores_junk_and_strangers():
    m = Membership("a", "127.0.0.1:1", admit=lambda p: p != "evil", interval_s=0.01)
    assert m.merge([_entry("b", hb=3, round=2), _entry("evil"), {"id": 5}, "junk", _entry("a", hb=99)]) == 1
    assert m.ids() == ["a", "b"]
    assert m.merge([_entry("b", hb=2, round=1)]) == 0  # older: ignored
    assert m.info_of("b")["round"] == 2
    assert m.merge([_entry("b", hb=4, round=3)]) == 1
    assert m.info_of("b")["round"] == 3
    assert m.merge("not a list") == 0


def test_a_change_of_info_travels_with_the_next_digest_without_waiting_for_a_beat():
    a, b = Membership("a", "127.0.0.1:1"), Membership("b", "127.0.0.1:2")
    b.merge(a.digest())
    a.set_info(round=3, done=True)  # a peer's last words before it stops, with no beat after them
    assert b.merge(a.digest()) == 1
    assert b.info_of("a") == {"round": 3, "done": True}


def test_silent_member_is_suspected_then_removed_and_stale_gossip_cannot_revive_it():
    now = [100.0]  # a manual clock: silence is measured in heartbeat intervals, not in luck
    m = Membership("a", "127.0.0.1:1", interval_s=0.02, suspect_after=2, remove_after=4, clock=lambda: now[0])
    m.merge([_entry("b", hb=5), _entry("c", hb=5)])
    now[0] += 0.03  # 1.5 intervals: nobody is silent long enough yet
    assert m.check() == []
    now[0] += 0.03
    m.merge([_entry("c", hb=6)])  # c keeps beating, b is silent (3 intervals)
    assert m.check() == [("suspected", "b")]
    assert m.ids() == ["a", "b", "c"]  # suspected members stay in the topology until removed
    now[0] += 0.06  # b: 6 intervals
    m.merge([_entry("c", hb=7)])
    assert m.check() == [("removed", "b")]
    assert m.ids() == ["a", "c"]
    m.merge([_entry("b", hb=5)])  # someone still gossips the dead b: not revived
    assert "b" not in m.ids()
    m.merge([_entry("b", inc=2, hb=0)])  # b restarted (new incarnation): rejoins at once
    assert "b" in m.ids()


def test_every_peer_derives_the_same_topology_from_sorted_ids():
    ids = [f"{k:064x}" for k in (7, 3, 9, 1, 5)]
    views = []
    for me in ids:
        m = Membership(me, "127.0.0.1:1")
        m.merge([_entry(p) for p in ids if p != me])
        views.append(m.view("ring"))
    assert all(v.ids == tuple(sorted(ids)) for v in views)
    for v in views:  # symmetric: i lists j as a neighbour iff j lists i, with the same weight
        for j in v.neighbors():
            other = views[ids.index(j)]
            assert v.ids[v.index] in other.neighbors()
            assert v.weights()[j] == other.weights()[v.ids[v.index]]
    alone = Membership("a", "127.0.0.1:1").view("ring")
    assert alone.neighbors() == [] and alone.weights() == {"a": 1.0}


def test_inbox_waits_with_a_timeout_and_bounds_rounds():
    box = Inbox(window=2)
    box.set_round(5)
    assert box.put("model", 5, "b", 1) and not box.put("model", 9, "b", 1) and not box.put("model", 1, "b", 1)
    assert box.late == 1
    t0 = time.monotonic()
    assert box.wait("model", 5, ["b", "c"], timeout=0.2) == {"b": 1}  # c never answers: one timeout
    assert 0.15 < time.monotonic() - t0 < 10  # waited its timeout out, and did not hang
    assert box.wait("model", 5, ["b"], timeout=5) == {"b": 1}  # all there: no wait


def test_a_peer_that_falls_behind_still_trains_the_final_round(tmp_path):
    """Catch-up jumps a lagging peer to the round its neighbours are in; when they have
    finished every round, that is the final round, not one past it (the peer would end on
    a model that never saw round R). p1 is held, by an event, until it sees p0 done."""
    import threading

    from tests.helpers import wait_until
    from tests.swarm_helpers import make_peers, run_all

    rounds = 3
    p0, p1 = make_peers(tmp_path, 2, rounds=rounds, round_timeout_s=0.5, linger_s=60.0, local_steps=1)
    release = threading.Event()
    held = threading.Event()
    next_round = p1.driver.next_round

    def held_next_round(r: int) -> int:
        held.set()
        assert release.wait(120), "the test never released p1"
        return next_round(r)

    p1.driver.next_round = held_next_round
    results: list = []
    runner = threading.Thread(target=lambda: results.append(run_all([p0, p1], timeout=180)))
    runner.start()
    try:
        assert held.wait(120), "p1 never reached its first round"
        # p0 trains all its rounds alone (each waits one timeout for p1), and p1 hears it finished
        wait_until(lambda: p1.membership.info_of(p0.id).get("round") == rounds, 120, what="p1 seeing p0 finish")
        release.set()
        runner.join(240)
    finally:
        release.set()
        p0.stop.set()
        p1.stop.set()
    (r0, r1), = results
    assert r0["rounds_done"] == rounds
    assert r1["rounds_done"] == rounds, "the lagging peer ended without the final round"
    (row,) = r1["rows"]  # it skipped the rounds p0 had finished without it, and trained the last one
    assert row["round"] == rounds and row["answered"] == 1  # with p0's round-R model, still in its inbox
