"""FedBuff: its fold against hand-computed values, the event order, staleness refusals, and whole
runs on the in-process engine (determinism, the recorded aggregation rows)."""

from __future__ import annotations

import math

import pytest
import torch

from fedswarm.algorithms.fedbuff import AsyncSchedule, FedBuffer, Stale, staleness_weight
from fedswarm.config import RunConfig
from fedswarm.errors import ConfigError
from tests.helpers import record_run


def test_staleness_weights_by_hand():
    poly = staleness_weight("poly:0.5")
    assert poly(0) == 1.0 and poly(3) == pytest.approx(0.5) and poly(8) == pytest.approx(1 / 3)
    assert staleness_weight("const")(17) == 1.0
    hinge = staleness_weight("hinge:0.5,2")  # 1 up to 2 versions, then 1 / (0.5 (tau - 2) + 1)
    assert [hinge(t) for t in (0, 2, 4, 8)] == pytest.approx([1.0, 1.0, 0.5, 0.25])
    for bad in ("poly:x", "hinge:1", "cubic", "poly:-1", "const:2"):
        with pytest.raises(ConfigError, match="staleness_weight"):
            staleness_weight(bad)


def test_fold_matches_a_hand_oracle():
    """K = 3 updates arrive in a fixed order with staleness 0, 3 and 8 (weights 1, 1/2, 1/3 under
    poly:0.5): x + lr * (1*a + b/2 + c/3) / 3, worked out by hand."""
    buf = FedBuffer(3, staleness_weight("poly:0.5"), max_staleness=None, server_lr=0.6)
    x = torch.tensor([1.0, -1.0, 0.0])
    assert buf.add(torch.tensor([3.0, 0.0, 0.0]), 0) == 1.0
    assert not buf.ready
    assert buf.add(torch.tensor([0.0, 4.0, 0.0]), 3) == pytest.approx(0.5)
    assert buf.add(torch.tensor([0.0, 0.0, 9.0]), 8) == pytest.approx(1 / 3)
    assert buf.ready
    new, metrics = buf.fold(x)
    # (3, 2, 3) / 3 = (1, 2/3, 1); times 0.6 = (0.6, 0.4, 0.6)
    assert new.tolist() == pytest.approx([1.6, -0.6, 0.6], abs=1e-6)
    assert metrics == {"updates": 3, "staleness_min": 0.0, "staleness_mean": pytest.approx(11 / 3),
                       "staleness_max": 8.0}
    assert not buf.ready and not buf.deltas  # emptied


def test_fold_with_dp_privatizes_the_weighted_updates():
    """--dp: the mechanism gets each update times its staleness weight (clipped and noised there);
    its noised mean is the step."""
    seen = []

    def privatize(x):
        seen.append(x.clone())
        return torch.tensor([0.5, -0.5]), {"epsilon": 1.25}

    buf = FedBuffer(2, staleness_weight("poly:1"), server_lr=2.0)
    buf.add(torch.tensor([1.0, 1.0]), 0)
    buf.add(torch.tensor([4.0, -2.0]), 1)  # weight 1/2
    new, metrics = buf.fold(torch.tensor([1.0, 1.0]), privatize)
    assert seen[0].tolist() == [[1.0, 1.0], [2.0, -1.0]]
    assert new.tolist() == [2.0, 0.0] and metrics["epsilon"] == 1.25 and metrics["updates"] == 2


def test_max_staleness_refuses_with_the_reason():
    buf = FedBuffer(2, staleness_weight("const"), max_staleness=2)
    buf.add(torch.ones(2), 2)
    with pytest.raises(Stale, match=r"stale: 3 versions old > max_staleness 2"):
        buf.add(torch.ones(2), 3)
    assert len(buf.deltas) == 1  # the refused update is not buffered


def test_schedule_orders_arrivals_by_simulated_finish():
    """Node 2 is 10x slower: with 3 slots every arrival comes in finish-time order and the slow
    node's comes back only after the fast ones have come and gone several times."""
    dur = {1: 1.0, 2: 10.0, 3: 1.5}
    sched = AsyncSchedule([3, 1, 2], concurrency=3, duration=dur.__getitem__, seed=0)
    assert sorted(j.node for j in sched.dispatch(0)) == [1, 2, 3]
    arrivals = []
    for version in range(1, 8):
        job = sched.arrive()
        arrivals.append((job.finish, job.node))
        sched.dispatch(version)
    assert [f for f, _ in arrivals] == sorted(f for f, _ in arrivals)
    assert [n for _, n in arrivals] == [1, 3, 1, 3, 1, 1, 3]
    assert sched.now == pytest.approx(4.5)
    assert [(j.node, j.finish) for j in (sched.arrive(), sched.arrive())] == [(1, 5.0), (3, 6.0)]
    assert [(j.node, j.finish, j.version) for j in sched.flying] == [(2, 10.0, 0)]  # still on version 0


def test_schedule_equal_speeds_is_first_dispatched_first_arrived():
    sched = AsyncSchedule(range(1, 6), concurrency=2, seed=3)
    order = [j.node for j in sched.dispatch(0)]
    got = []
    for v in range(6):
        got.append(sched.arrive().node)
        order += [j.node for j in sched.dispatch(v + 1)]
    assert got == order[:6]


def _run(tmp_path, name: str, **kw):
    base = dict(strategy="fedbuff", task="synthetic-logreg", clients=6, rounds=4, local_steps=2, seed=3,
                eval_every=1000)
    _, result, nodes = record_run(RunConfig.model_validate({**base, **kw}), tmp_path / f"{name}.db")
    return result, nodes


def test_stale_updates_are_rejected_and_recorded(tmp_path):
    """Concurrency 6 and K = 2: the nodes dispatched with version 0 arrive 0, 0, 1, 1, 2, 2 versions
    late (equal speeds); max_staleness 1 refuses the last two with the reason on their rows."""
    res, nodes = _run(tmp_path, "stale", params={"buffer_size": 2, "concurrency": 6, "max_staleness": 1})
    rows = res["rounds"][1:]
    assert [r["model_version"] for r in rows] == [1, 2, 3, 4]
    rejected = [n for n in nodes if n.status == "rejected"]
    assert rejected and all(n.reason.startswith("stale: 2 versions old > max_staleness 1") for n in rejected)
    assert sum(r.get("rejected", 0) for r in rows) == len(rejected)
    assert all(r["staleness_max"] <= 1 for r in rows)


def test_runs_are_deterministic_for_a_seed(tmp_path):
    kw = dict(params={"buffer_size": 2, "concurrency": 4}, devices="edge-wifi:4,straggler:2")
    a, _ = _run(tmp_path, "a", **kw)
    b, _ = _run(tmp_path, "b", **kw)
    keys = ("test_loss", "test_accuracy", "staleness_mean", "sim_time_s", "model_version")
    assert [[r.get(k) for k in keys] for r in a["rounds"]] == [[r.get(k) for k in keys] for r in b["rounds"]]
    c, _ = _run(tmp_path, "c", seed=4, **kw)
    assert [r["test_loss"] for r in c["rounds"][1:]] != [r["test_loss"] for r in a["rounds"][1:]]


def test_stragglers_arrive_stale_on_the_virtual_clock(tmp_path):
    """With --devices, an aggregation waits for no straggler: the simulated time between
    aggregations is the fast nodes' and the stragglers' updates carry staleness."""
    res, nodes = _run(tmp_path, "fleet", rounds=8, params={"buffer_size": 2, "concurrency": 6},
                      devices="edge-wifi:4,straggler:2")
    rows = res["rounds"][1:]
    # nodes still training when an aggregation is made are in flight, not failed
    assert nodes and not [n for n in nodes if n.status != "ok"]
    assert [r["num_clients"] for r in rows] == [sum(map(len, r["staleness_by_node"].values())) for r in rows]
    assert all(r["sim_time_s"] is not None for r in rows)
    assert max(r["staleness_max"] for r in rows) >= 2
    clock = [r["sim_clock_s"] for r in rows]
    assert clock == sorted(clock) and math.isclose(sum(r["sim_time_s"] for r in rows), clock[-1])


def test_fleet_options_are_refused_in_one_line():
    from fedswarm.server.app import prepare_strategy

    for opt in ({"quorum": 2}, {"over_select": 1.5}):
        cfg = RunConfig.model_validate(dict(strategy="fedbuff", clients=4, **opt))
        with pytest.raises(ConfigError, match="fedbuff does not take --") as exc:
            prepare_strategy(cfg)
        assert "\n" not in str(exc.value)
    with pytest.raises(ConfigError, match="fedbuff --devices: its virtual clock runs on --engine inprocess"):
        prepare_strategy(RunConfig(strategy="fedbuff", clients=4, devices="edge-wifi:4", engine="flower"))


def test_availability_dispatches_only_nodes_that_are_on_and_gives_up_dropped_ones(tmp_path):
    """--availability on the in-process engine: a dispatch whose node drops (or goes off) mid-training
    never arrives; the aggregation that gives it up (after round_timeout, simulated) counts it as lost
    and its node row is failed. Deterministic for a seed."""
    kw = dict(rounds=6, devices="edge-wifi:4,straggler:2", round_timeout=5.0, clients=6,
              availability="on=6,off=4,diurnal=0.5,period=60,dropout=0.3", params={"buffer_size": 2, "concurrency": 4})
    res, nodes = _run(tmp_path, "av", **kw)
    rows = res["rounds"][1:]
    lost = sum(r["lost"] for r in rows)
    failed = [n for n in nodes if n.status == "failed"]
    assert lost > 0 and 0 < len(failed) <= lost  # one row per node and aggregation: a node may be lost twice
    assert all(n.reason == "no reply before the round's timeout" for n in failed)
    assert [r["model_version"] for r in rows] == list(range(1, 7)) and all(r["updates"] == 2 for r in rows)
    again, _ = _run(tmp_path, "av2", **kw)
    assert [(r["lost"], r["sim_clock_s"], r["test_loss"]) for r in again["rounds"][1:]] == \
        [(r["lost"], r["sim_clock_s"], r["test_loss"]) for r in rows]


def test_schedule_dispatches_only_available_nodes():
    from fedswarm.availability import Availability

    class Half(Availability):  # node pid is on when t is in [pid, pid + 1) and never drops
        def __init__(self):
            pass

        def available(self, pid, t):
            return pid <= t < pid + 1

        def next_on(self, pid, t):
            return float(pid) if t <= pid else None

        def session_end(self, pid, t):
            return pid + 1.0

        def drops(self, pid, seq):
            return False

    sched = AsyncSchedule([1, 2, 3], concurrency=3, duration=lambda n: 0.5, availability=Half())
    assert [j.node for j in sched.dispatch(0)] == [1] and sched.now == 0.0  # only pid 0 is on at t = 0
    assert sched.arrive().finish == 0.5
    assert sched.dispatch(1)[0].node == 1  # pid 0 is still on at 0.5, the others not yet
    sched.arrive()
    assert [j.node for j in sched.dispatch(2)] == [2] and sched.now == 1.0  # all off at 1.0 but pid 1: on
    job = sched.flying[0]
    assert not job.lost and job.finish == 1.5


def test_deployment_path_folds_replies_pulled_together_k_at_a_time(tmp_path, monkeypatch):
    """The deployment's arrival source (no virtual clock) on the in-process grid, whose pull hands
    back every reply in flight at once: the six pulled together make three aggregations of exactly
    K = 2, each one version staler than the last (their start model kept until folded)."""
    from fedswarm.strategies.federated.fedbuff import FedBuff

    monkeypatch.setattr(FedBuff, "use_virtual_clock", lambda self, simulated: setattr(self, "simulated", False))
    res, nodes = _run(tmp_path, "real", params={"buffer_size": 2, "concurrency": 6})
    rows = res["rounds"][1:]
    assert [r["updates"] for r in rows] == [2, 2, 2, 2]
    assert [sorted(s for v in r["staleness_by_node"].values() for s in v) for r in rows[:3]] == [[0, 0], [1, 1], [2, 2]]
    assert not [n for n in nodes if n.status != "ok"]


class _QueueGrid:
    """A fake Grid's push: each message gets an id and waits in ``queue`` for the fake's pull."""

    def __init__(self):
        self.queue, self.probes = {}, 0

    def push_messages(self, msgs):
        ids = []
        for m in msgs:
            mid = f"m{len(self.queue)}-{m.metadata.dst_node_id}"
            m.metadata.__dict__["_message_id"] = mid
            self.queue[mid] = m
            ids.append(mid)
        return ids


def test_a_malformed_reply_is_rejected_with_its_reason_and_never_folded():
    """Node 11 answers garbage (not finite), node 12 a model one above what it was sent: with K = 1
    and constant weights each aggregation is node 12's model; node 11's replies are refused, named."""
    import numpy as np
    from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict

    from fedswarm.strategies.federated.fedbuff import FedBuff
    from fedswarm.wire import arrayrecord_to_vector, vector_to_arrayrecord

    class Grid(_QueueGrid):
        def get_node_ids(self):
            return [11, 12]

        def pull_messages(self, ids):
            out = []
            for mid in ids:
                m = self.queue.pop(mid)
                if m.metadata.dst_node_id == 11:
                    arrays = ArrayRecord({"w": Array(np.array([np.nan, 1.0, np.inf], dtype=np.float32))})
                else:
                    arrays = vector_to_arrayrecord(arrayrecord_to_vector(m.content["arrays"]) + 1)
                reply = Message(RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": 5})}),
                                reply_to=m)
                reply.metadata.__dict__["_src_node_id"] = m.metadata.dst_node_id
                out.append(reply)
            return out

    strategy = FedBuff(buffer_size=1, concurrency=2, staleness_weight_spec="const", min_nodes=2, poll_s=0.01)
    result = strategy.start(Grid(), vector_to_arrayrecord(torch.zeros(3)), num_rounds=2, timeout=30)
    assert arrayrecord_to_vector(result.arrays).tolist() == [2.0, 2.0, 2.0]  # two folds of +1
    assert strategy.version == 2
    assert "11" in strategy.notes.rejections and "finite" in strategy.notes.rejections["11"]


def test_a_codec_upload_is_timed_at_its_payload_size_on_the_virtual_clock():
    """With --devices and an uplink codec, a node's simulated time is the model down, its local steps and the
    codec's payload up (top-k at 5 %: 8 bytes a kept coordinate), not the whole model up; the same formula
    from the time model's own pieces."""
    from fedswarm.server.app import prepare_strategy
    from fedswarm.timemodel import BUILTIN_PROFILES, compute_time_s, transfer_time_s

    base = dict(strategy="fedbuff", task="digits-mlp", clients=4, local_steps=2, batch_size=16,
                devices="edge-lte:4")
    plain = prepare_strategy(RunConfig.model_validate(base)).strategy
    topk = prepare_strategy(RunConfig.model_validate(
        {**base, "params": {"codec": "topk", "codec_params": "ratio=0.05"}})).strategy
    d = topk.layout.d
    up = topk.codec.wire_bytes(topk.layout)
    assert 0 < up < 0.2 * 4 * d
    p = BUILTIN_PROFILES["edge-lte"]
    down_and_compute = transfer_time_s(p, 4.0 * d) + compute_time_s(p, samples=32.0)
    assert math.isclose(topk.duration(1), down_and_compute + transfer_time_s(p, float(up)), rel_tol=1e-12)
    assert math.isclose(plain.duration(1), down_and_compute + transfer_time_s(p, 4.0 * d), rel_tol=1e-12)
    assert topk.duration(1) < plain.duration(1)


@pytest.mark.parametrize("path", ["deployment", "flower"])
def test_probed_eligibility_dispatches_only_nodes_whose_own_telemetry_passes(tmp_path, monkeypatch, path):
    """--eligible under FedBuff where each node reports its own telemetry, on the in-process grid: the
    deployment's path (no virtual clock) and the flower engine's (the virtual clock, node ids not
    partitions). Node 3's probe answer says 5 % battery, the others' say nothing of a battery. Node 3 is
    never sent a model; it has an ``ineligible`` row naming the clause in every aggregation, it is not
    probed again within ``REPROBE_S`` (set far beyond the run here), and the others fold K = 2 each time."""
    from fedswarm.client import app as client_app
    from fedswarm.protocol import TELEMETRY_RECORD
    from fedswarm.strategies.federated import fedbuff_eligibility
    from fedswarm.strategies.federated.fedbuff import FedBuff

    def clock(self, simulated):
        self.simulated = path == "flower"
        self.partition_nodes = False

    monkeypatch.setattr(FedBuff, "use_virtual_clock", clock)
    monkeypatch.setattr(fedbuff_eligibility, "REPROBE_S", 1e9)
    answer = client_app.answer_telemetry
    probed: list[int] = []

    def low_battery_on_partition_2(msg, context):
        content = answer(msg, context)
        pid = int(content["node"]["partition-id"])
        probed.append(pid)
        tel = content.config_records[TELEMETRY_RECORD]
        tel.pop("battery_pct", None)  # the machine's own battery (if any) is no node's here
        if pid == 2:
            tel["battery_pct"] = 5.0
        return content

    monkeypatch.setattr(client_app, "answer_telemetry", low_battery_on_partition_2)
    res, nodes = _run(tmp_path, "probed", eligible="battery>=40", params={"buffer_size": 2, "concurrency": 6})
    rows = res["rounds"][1:]
    assert [r["model_version"] for r in rows] == [1, 2, 3, 4] and all(r["updates"] == 2 for r in rows)
    mine = sorted((n.round, n.status, n.reason) for n in nodes if n.node_id.endswith("3") and n.round > 0)
    assert mine == [(k, "ineligible", "not eligible (battery>=40): battery 5 fails battery>=40") for k in (1, 2, 3, 4)]
    assert all(n.telemetry["battery_pct"] == 5.0 for n in nodes if n.node_id.endswith("3") and n.round > 0)
    assert not any("3" in r["staleness_by_node"] for r in rows)
    trained = {node for r in rows for node in r["staleness_by_node"]}
    assert trained and trained <= {"1", "2", "4", "5", "6"}
    # one probe each: the first; then node 3's back-off, and the others are being sent models (not probed)
    assert sorted(probed) == list(range(6)), probed


def test_deployment_path_fails_when_no_node_is_eligible(monkeypatch):
    """Every node's telemetry fails the rules and none is training: the dispatch probes again until
    round_timeout, then fails naming the clause (a fake grid whose nodes answer a 5 % battery)."""
    from flwr.app import ConfigRecord, Message, RecordDict

    from fedswarm.eligibility import parse_rules
    from fedswarm.protocol import TELEMETRY_RECORD
    from fedswarm.strategies.federated.fedbuff_eligibility import ProbedRules

    class Grid(_QueueGrid):
        def push_messages(self, msgs):
            self.probes += 1
            return super().push_messages(msgs)

        def pull_messages(self, ids):
            out = []
            for mid in list(ids):
                m = self.queue.pop(mid, None)
                if m is not None:
                    reply = Message(RecordDict({TELEMETRY_RECORD: ConfigRecord({"battery_pct": 5.0}),
                                                "node": ConfigRecord({"device_class": "phone"})}), reply_to=m)
                    reply.metadata.__dict__["_src_node_id"] = m.metadata.dst_node_id
                    out.append(reply)
            return out

    grid = Grid()
    rules = ProbedRules(parse_rules("battery>=40"), grid, wait_s=0.3, retry_s=0.05)
    with pytest.raises(RuntimeError, match=r"no node is eligible.*battery>=40: battery 5 fails battery>=40"):
        rules.eligible_idle([7, 8], ConfigRecord({}), busy=False)
    assert grid.probes >= 2 and rules.classes == {7: "phone", 8: "phone"}
    # busy: it does not wait; a class's own eligible policy overrides --eligible
    assert rules.eligible_idle([7, 8], ConfigRecord({"policy.phone": '{"eligible": "battery<=10"}'}),
                               busy=True) == [7, 8]
