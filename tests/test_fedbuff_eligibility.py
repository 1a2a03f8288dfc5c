"""FedBuff's eligibility where each node reports its own telemetry (``ProbedRules``: a deployment, the
flower engine): no model to a node that has said nothing yet, a class ``eligible`` policy added
mid-run, and the back-off of an ineligible idle node's probe. Fake grids whose nodes answer the probe
when the test says so, and one in-process run with a policy control."""

from __future__ import annotations

import pytest
from flwr.app import ConfigRecord, Message, RecordDict

from fedswarm.config import RunConfig
from fedswarm.eligibility import parse_rules
from fedswarm.protocol import TELEMETRY_RECORD
from fedswarm.strategies.federated.fedbuff_eligibility import NO_REPORT, ProbedRules


class ProbeGrid:
    """Nodes that answer the telemetry probe with ``battery[node]`` (None: no battery) once ``awake``
    says so; ``probes[node]``: how many probes each got."""

    def __init__(self, battery: dict[int, float | None], awake=lambda node: True):
        self.battery, self.awake = battery, awake
        self.queue: dict[str, Message] = {}
        self.probes: dict[int, int] = {}

    def push_messages(self, msgs):
        ids = []
        for m in msgs:
            node = m.metadata.dst_node_id
            self.probes[node] = self.probes.get(node, 0) + 1
            mid = f"m{len(self.queue)}-{node}-{sum(self.probes.values())}"
            m.metadata.__dict__["_message_id"] = mid
            self.queue[mid] = m
            ids.append(mid)
        return ids

    def pull_messages(self, ids):
        out = []
        for mid in list(ids):
            m = self.queue.get(mid)
            if m is None or not self.awake(m.metadata.dst_node_id):
                continue
            del self.queue[mid]
            b = self.battery[m.metadata.dst_node_id]
            tel = ConfigRecord({} if b is None else {"battery_pct": float(b)})
            reply = Message(RecordDict({TELEMETRY_RECORD: tel, "node": ConfigRecord({"device_class": "phone"})}),
                            reply_to=m)
            reply.metadata.__dict__["_src_node_id"] = m.metadata.dst_node_id
            out.append(reply)
        return out


RULES = parse_rules("battery>=40")


def test_a_node_whose_probe_has_not_answered_is_never_dispatched():
    """Node 7 (5 % battery) answers its probe only after the first dispatch: that dispatch takes node 8
    alone and passes 7 over as not known yet; the next one reads 7's answer and passes it over for
    its battery. With nothing training and nothing known, the dispatch waits for the answers."""
    late = {"7": False}
    grid = ProbeGrid({7: 5.0, 8: None}, awake=lambda node: node != 7 or late["7"])
    rules = ProbedRules(RULES, grid, probe_timeout_s=0.05, retry_s=0.01)
    assert rules.eligible_idle([7, 8], ConfigRecord({}), busy=False) == [8]
    assert rules.passed == {7: (None, NO_REPORT)}
    (row,) = rules.rows(lambda n: False)
    assert row["node_id"] == "7" and row["status"] == "ineligible" and row["reason"] == f"not eligible: {NO_REPORT}"
    late["7"] = True
    assert rules.eligible_idle([7], ConfigRecord({}), busy=True) == []
    (row,) = rules.rows(lambda n: False)
    assert row["reason"] == "not eligible (battery>=40): battery 5 fails battery>=40"
    assert grid.probes == {7: 1, 8: 1}  # its one probe was out all along: not asked twice

    # nothing training, nobody has answered yet: it waits for the first answer rather than send a model
    pulls = {"n": 0}

    def after_three_pulls(node):
        pulls["n"] += 1
        return pulls["n"] > 3

    rules = ProbedRules(RULES, ProbeGrid({1: 90.0}, awake=after_three_pulls), probe_timeout_s=0.01, retry_s=0.01)
    assert rules.eligible_idle([1], ConfigRecord({}), busy=False) == [1]
    assert pulls["n"] > 3 and rules.telemetry[1] == {"battery_pct": 90.0}


def test_an_ineligible_idle_node_is_probed_again_only_after_the_back_off():
    """Node 7 (5 %) idles while 8 trains: one probe at the start, none at the aggregations within
    ``reprobe_s`` of it, one again after; its answer then (charged: 80 %) makes it eligible. Node 9
    (eligible, left idle, silent) is probed at every aggregation, as the fleet grid does, but not when
    it is sent a model."""
    now = [0.0]
    grid = ProbeGrid({7: 5.0, 8: None, 9: None})
    rules = ProbedRules(RULES, grid, reprobe_s=30.0, clock=lambda: now[0])
    cfg = ConfigRecord({})
    assert rules.eligible_idle([7, 8, 9], cfg, busy=False) == [8, 9]
    rules.rows(lambda n: False)
    for t in (10.0, 20.0, 29.0):  # aggregations within the back-off; 9 left idle (no free slot)
        now[0] = t
        assert rules.eligible_idle([7, 9], cfg, busy=True) == [9]
        rules.probe_left([7, 9], cfg)
        rules.probe_left([7, 9], cfg)  # (once an aggregation)
        assert [r["node_id"] for r in rules.rows(lambda n: False)] == ["7"]
    assert grid.probes == {7: 1, 8: 1, 9: 4}
    now[0] = 30.0
    assert rules.eligible_idle([7], cfg, busy=True) == []
    rules.probe_left([7], cfg)  # 9 was sent a model: not probed (its train reply will say)
    assert grid.probes == {7: 2, 8: 1, 9: 4}
    rules.rows(lambda n: False)
    now[0] = 45.0
    assert rules.eligible_idle([7], cfg, busy=True) == []  # its answer (5 % still) read
    rules.probe_left([7], cfg)  # within the back-off of its probe at 30 s
    rules.rows(lambda n: False)
    grid.battery[7] = 80.0
    now[0] = 61.0
    assert rules.eligible_idle([7], cfg, busy=True) == []
    rules.probe_left([7], cfg)
    assert grid.probes == {7: 3, 8: 1, 9: 4}
    rules.rows(lambda n: False)
    assert rules.eligible_idle([7], cfg, busy=True) == [7]  # charged: its answer read at the next dispatch
    assert rules.rows(lambda n: False) == []


def test_a_class_eligible_policy_changed_mid_run_is_read_at_the_next_dispatch():
    """No --eligible: nothing is probed, every idle node may train. A policy for class phone then
    asks battery>=40 (the train config as a policy control leaves it): the next dispatch probes every
    node that did not just train and passes 7 over; loosened to battery>=3, 7 may train again."""
    grid = ProbeGrid({7: 5.0, 8: None})
    rules = ProbedRules(None, grid, reprobe_s=1e9)
    cfg = ConfigRecord({"policy.phone": '{"local_steps": 2}'})
    assert rules.eligible_idle([7, 8], cfg, busy=False) == [7, 8] and grid.probes == {}
    rules.rows(lambda n: False)
    cfg["policy.phone"] = '{"eligible": "battery>=40", "local_steps": 2}'
    assert rules.eligible_idle([7, 8], cfg, busy=False) == [8] and grid.probes == {7: 1, 8: 1}
    rules.rows(lambda n: False)
    cfg["policy.phone"] = '{"eligible": "battery>=3", "local_steps": 2}'
    assert rules.eligible_idle([7], cfg, busy=True) == [7] and grid.probes == {7: 1, 8: 1}


@pytest.mark.parametrize("path", ["deployment", "flower"])
def test_a_policy_control_mid_run_makes_a_class_ineligible(tmp_path, monkeypatch, path):
    """The whole run, on the in-process grid with FedBuff's deployment path (and the flower engine's):
    no --eligible; after aggregation 1 a ``policy`` control gives class edge-lte (node 6 alone)
    ``eligible = rss<=1`` (a peak memory no process has). Node 6 is never dispatched again: it has an
    ineligible row naming the clause in every aggregation after its version-0 update arrived, and it
    sends no update of a later version."""
    from fedswarm.sim.inprocess import run_inprocess
    from fedswarm.store import Store
    from fedswarm.strategies.federated.fedbuff import FedBuff

    def clock(self, simulated):
        self.simulated = path == "flower"
        self.partition_nodes = False

    monkeypatch.setattr(FedBuff, "use_virtual_clock", clock)
    cfg = RunConfig.model_validate(dict(strategy="fedbuff", task="synthetic-logreg", clients=6, rounds=6,
                                        local_steps=2, seed=3, eval_every=1000, devices="edge-wifi:5,edge-lte:1",
                                        params={"buffer_size": 2, "concurrency": 6}))
    store = Store(tmp_path / "policy.db")
    try:
        rid = store.create_run(cfg.model_dump())

        def change(rnd, row):
            if rnd == 1:
                store.add_control(rid, "policy", {"device_class": "edge-lte", "policy": {"eligible": "rss<=1"}})

        assert run_inprocess(cfg, store=store, run_id=rid, listeners=[change]) == "finished"
        rounds = [r for r in store.rounds(rid) if r.round > 0]
        nodes = store.node_rounds(rid)
    finally:
        store.close()
    assert [r.metrics["model_version"] for r in rounds] == [1, 2, 3, 4, 5, 6]
    versions = {}  # node -> the model versions of its folded updates
    for r in rounds:
        for node, stal in r.metrics["staleness_by_node"].items():
            versions.setdefault(node, []).extend(r.round - 1 - s for s in stal)
    assert versions.get("6", []) in ([], [0]), versions  # nothing dispatched to it after the control
    mine = {n.round: n for n in nodes if n.node_id == "6"}
    arrived = {r.round for r in rounds if "6" in r.metrics["staleness_by_node"]}
    later = list(range(max(arrived | {1}) + 1, 7))  # idle from its version-0 update's arrival on
    assert later and all(mine[k].status == "ineligible" and "rss" in mine[k].reason and "fails rss<=1" in mine[k].reason
                         for k in later), {k: (n.status, n.reason) for k, n in mine.items()}
    assert 1 not in mine or mine[1].status != "ineligible"  # aggregation 1 ran before the policy
    assert len(versions) >= 5 and all(len(v) >= 1 for n, v in versions.items() if n != "6")
