"""FedBuff on the batched engine: the same models as the in-process engine for the same seed and
fleet (1e-5), and the same recorded aggregations (versions, staleness, simulated time, refusals)."""

from __future__ import annotations

import pytest

from tests.test_batched import same_models_on_both_engines

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

