"""FedBuff on the batched engine: the same models as the in-process engine for the same seed and
fleet (1e-5), and the same recorded aggregations (versions, staleness, simulated time, refusals)."""

from __future__ import annotations

import pytest

from tests.test_batched import same_models_on_both_engines
from tests.test_batched_fleet import _rows as _node_rows  # (round, node, status, reason) of a run's nodes

SAME = ("model_version", "updates", "staleness_min", "staleness_mean", "staleness_max", "staleness_by_node",
        "in_flight", "sim_time_s", "sim_clock_s", "rejected", "num_clients", "epsilon", "fed_examples")
# the batched engine scores a cohort in one pass and sums in float64 (sim/batched_eval.py), the in-process
# nodes each in float32: the same figures to float rounding, as tests/test_fed_eval.py holds them
CLOSE = ("fed_accuracy", "fed_loss")


@pytest.mark.parametrize("kw", [
    # a timed fleet with stragglers: stale updates, waves of clients from different versions
    dict(clients=8, rounds=5, devices="edge-wifi:6,straggler:2",
         params={"buffer_size": 3, "concurrency": 6, "staleness_weight": "hinge:0.5,1", "server_lr": 0.8}),
    # equal speeds, every client in flight, refusals past max_staleness
    # ... with federated evaluation after every aggregation, by the nodes that arrived (not those in flight)
    dict(clients=6, rounds=5, eval_every=1, params={"buffer_size": 2, "concurrency": 6, "max_staleness": 1}),
    # --dp: clipped, noised once per aggregation by the strategy's own mechanism, on both engines
    dict(clients=6, rounds=4, dp="noise_multiplier=0.8,clip=0.3", params={"buffer_size": 2, "concurrency": 4}),
    # fast nodes arrive twice in one aggregation (K = 4 > concurrency 3): one row per node, bytes summed
    dict(clients=6, rounds=4, devices="edge-wifi:4,straggler:2", params={"buffer_size": 4, "concurrency": 3}),
    # compressed uploads with error feedback: top-k of (delta + residual), decoded by the server, stale waves
    dict(clients=8, rounds=4, devices="edge-wifi:6,straggler:2",
         params={"buffer_size": 3, "concurrency": 6, "codec": "topk", "codec_params": "ratio=0.1"}),
    # a codec with per-client randomness (QSGD) under central --dp, which clips the decoded updates
    dict(clients=6, rounds=3, dp="noise_multiplier=0.8,clip=0.3",
         params={"buffer_size": 2, "concurrency": 4, "codec": "qsgd"}),
], ids=["stragglers", "max-staleness", "dp", "twice", "topk-ef", "dp-qsgd"])
def test_batched_fedbuff_equals_inprocess(kw, tmp_path, monkeypatch):
    cfg = {"strategy": "fedbuff", "task": "digits-mlp", "local_steps": 3, "batch_size": 16, "seed": 7,
           "eval_every": 1000, **kw}
    ref, got, pairs = same_models_on_both_engines(cfg, tmp_path, monkeypatch)
    for a, b in pairs:
        assert {k: a.get(k) for k in SAME} == {k: b.get(k) for k in SAME}
        for k in CLOSE:
            assert b.get(k) == (None if a.get(k) is None else pytest.approx(a[k], rel=1e-6, abs=1e-9)), k
    if "dp" in kw:  # epsilon accounted once per aggregation
        eps = [a["epsilon"] for a, _ in pairs]
        assert eps == sorted(eps) and len(set(eps)) == len(eps) and eps[0] > 0
        assert all(a["dp_clip"] == 0.3 for a, _ in pairs)
    if kw.get("eval_every") == 1:  # every aggregation evaluated, by as many nodes as arrived
        assert all(a["fed_accuracy"] is not None for a, _ in pairs)
    if kw["params"].get("codec") == "topk":  # metered on the serialized payloads: ~10% of the model's bytes
        for a, b in pairs:  # (every message down carries the whole model)
            for row in (a, b):
                assert 0 < row["bytes_up"] < 0.3 * row["bytes_down"], (row["bytes_up"], row["bytes_down"])
    if kw["params"]["buffer_size"] > kw["params"]["concurrency"]:  # the case it names happened
        assert any(len(v) > 1 for a, _ in pairs for v in a["staleness_by_node"].values())
    if "max_staleness" in kw["params"]:
        assert sum(a.get("rejected", 0) for a, _ in pairs) > 0  # the refusals happened, on both engines
    else:
        assert max(a["staleness_max"] for a, _ in pairs) >= 2



@pytest.mark.parametrize("codec", [None, "topk"])
def test_batched_fedbuff_availability_equals_inprocess(codec, tmp_path, monkeypatch):
    """--availability under FedBuff on the batched engine: only nodes that are on are dispatched, a dispatch
    that drops (or outlasts its session) never trains and is given up after round_timeout (simulated) with a
    ``failed`` row; the same models, aggregations, lost counts and node rows as in-process.
    With a codec a lost dispatch's error-feedback residual does not move (its ClientApp never ran)."""
    params = {"buffer_size": 2, "concurrency": 4}
    if codec:
        params.update(codec=codec, codec_params="ratio=0.1")
    cfg = {"strategy": "fedbuff", "task": "digits-mlp", "local_steps": 2, "batch_size": 16, "seed": 3,
           "eval_every": 1000, "clients": 6, "rounds": 6, "devices": "edge-wifi:4,straggler:2",
           "round_timeout": 5.0, "availability": "on=6,off=4,diurnal=0.5,period=60,dropout=0.3", "params": params}
    ref, got, pairs = same_models_on_both_engines(cfg, tmp_path, monkeypatch)
    for a, b in pairs:
        assert {k: a.get(k) for k in SAME + ("lost",)} == {k: b.get(k) for k in SAME + ("lost",)}
    assert sum(a["lost"] for a, _ in pairs) > 0  # the case it names happened
    rows_ref, rows_got = _node_rows(tmp_path, "inprocess"), _node_rows(tmp_path, "batched")
    assert rows_got == rows_ref
    assert any(status == "failed" and reason == "no reply before the round's timeout"
               for _, _, status, reason in rows_ref)
    # a lost dispatch's message went down: the batched engine counts a message when its node arrives or is
    # given up (in-process counts it when pushed, on the aggregation it was pushed in), so each failed row
    # carries at least its one lost message, as large as the others
    bytes_got = _node_bytes(tmp_path, "batched")
    per_message = min(down for status, up, down in bytes_got.values() if status != "failed" and up > 0)
    assert per_message > 0
    assert all(down >= per_message for status, _, down in bytes_got.values() if status == "failed"), bytes_got


def _node_bytes(tmp_path, engine: str) -> dict:
    """(round, node) -> (status, bytes up, bytes down) of the run on ``engine``."""
    from fedswarm.store import Store

    store = Store(tmp_path / f"{engine}.db")
    try:
        rid = store.list_runs()[0].id
        return {(r.round, int(r.node_id)): (r.status, r.bytes_up, r.bytes_down) for r in store.node_rounds(rid)}
    finally:
        store.close()


def test_batched_fedbuff_eligible_equals_inprocess(tmp_path, monkeypatch):
    """--eligible under FedBuff: on the machine's telemetry (a 5 % battery) the straggler class fails
    --eligible, edge-wifi's own policy passes; only edge-wifi nodes are dispatched, the stragglers get an
    ``ineligible`` row in every aggregation, and both engines agree on models, figures and rows."""
    monkeypatch.setenv("FEDSWARM_FAKE_BATTERY", "5")
    cfg = {"strategy": "fedbuff", "task": "digits-mlp", "local_steps": 3, "batch_size": 16, "seed": 7,
           "eval_every": 1000, "clients": 8, "rounds": 4, "devices": "edge-wifi:6,straggler:2",
           "eligible": "battery>=40", "policies": {"edge-wifi": {"eligible": "battery<=10"}},
           "params": {"buffer_size": 3, "concurrency": 4}}
    ref, got, pairs = same_models_on_both_engines(cfg, tmp_path, monkeypatch)
    for a, b in pairs:
        assert {k: a.get(k) for k in SAME} == {k: b.get(k) for k in SAME}
    rows_ref, rows_got = _node_rows(tmp_path, "inprocess"), _node_rows(tmp_path, "batched")
    assert rows_got == rows_ref
    ineligible = [(rnd, node) for rnd, node, status, _ in rows_ref if status == "ineligible"]
    assert ineligible == [(rnd, node) for rnd in range(1, 5) for node in (7, 8)]
    assert all(reason == "not eligible (battery>=40): battery 5 fails battery>=40"
               for _, _, status, reason in rows_ref if status == "ineligible")
    trained = {node for _, node, status, _ in rows_ref if status != "ineligible"}
    assert trained and trained <= set(range(1, 7))  # never a straggler
    assert all(str(n) not in a["staleness_by_node"] for a, _ in pairs for n in (7, 8))


@pytest.mark.parametrize("engine", ["inprocess", "batched"])
def test_fedbuff_with_no_eligible_node_fails_saying_why(engine, tmp_path, monkeypatch):
    monkeypatch.setenv("FEDSWARM_FAKE_BATTERY", "5")
    from fedswarm.config import RunConfig
    from fedswarm.sim.run import run_engine
    from fedswarm.store import Store

    cfg = RunConfig(task="digits-mlp", strategy="fedbuff", engine=engine, clients=3, rounds=2, seed=0,
                    local_steps=1, eligible="battery>=40", params={"buffer_size": 2})
    store = Store(tmp_path / "none.db")
    try:
        rid = store.create_run(cfg.model_dump())
        with pytest.raises(RuntimeError, match="no node is eligible.*default: battery 5 fails battery>=40"):
            run_engine(cfg, store=store, run_id=rid)
    finally:
        store.close()


def test_fedbuff_eligible_probes_where_nodes_report_their_own():
    """In a deployment (nodes not simulated) and on the flower engine (node ids are not partitions)
    FedBuff's dispatch reads each node's own telemetry (ProbedRules, tests/test_fedbuff.py); it probes
    only when a rule applies, --eligible or a class's eligible policy."""
    from fedswarm.config import RunConfig
    from fedswarm.server.app import prepare_strategy
    from fedswarm.sim.engines import check_config
    from fedswarm.strategies.federated.fedbuff_eligibility import ProbedRules

    cfg = RunConfig(strategy="fedbuff", engine="flower", clients=2, eligible="battery>=40")
    assert check_config(cfg).name == "flower"
    assert prepare_strategy(cfg).strategy.partition_nodes is False
    assert prepare_strategy(cfg.model_copy(update={"engine": "inprocess"})).strategy.partition_nodes is True
    assert not ProbedRules.active({}, None)
    assert ProbedRules.active({"policy.default": '{"eligible": "charging"}'}, None)
    assert not ProbedRules.active({"policy.default": '{"local_steps": 2}'}, None)


def test_fedbuff_eligible_with_availability_inprocess(tmp_path, monkeypatch):
    """--eligible and --availability together (in-process): the ineligible class (fast gpu nodes: a dispatch
    would arrive) is never dispatched."""
    monkeypatch.setenv("FEDSWARM_FAKE_BATTERY", "5")
    from fedswarm.config import RunConfig
    from fedswarm.sim.run import run_engine
    from fedswarm.store import Store

    cfg = RunConfig(task="digits-mlp", strategy="fedbuff", clients=6, rounds=8, seed=1, local_steps=1,
                    devices="edge-wifi:4,gpu:2", availability="on=6,off=4,dropout=0.1", round_timeout=5.0,
                    eligible="battery>=40", policies={"edge-wifi": {"eligible": "battery<=10"}},
                    params={"buffer_size": 2, "concurrency": 3})
    store = Store(tmp_path / "av.db")
    try:
        rid = store.create_run(cfg.model_dump())
        assert run_engine(cfg, store=store, run_id=rid) == "finished"
        rows = store.node_rounds(rid)
        assert {r.node_id for r in rows if r.status == "ineligible"} == {"5", "6"}
        assert {r.node_id for r in rows if r.status != "ineligible"} <= {"1", "2", "3", "4"}
    finally:
        store.close()
