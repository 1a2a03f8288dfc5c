"""``sketched_sgd --secagg`` on the batched engine (sim/batched_secagg_sketch.py): its round's two
secure sums (the tables, then the exact values at the candidates) computed directly, against the
in-process engine's real protocol (SecAggGrid and the nodes' secagg_mod), with and without --dp,
with simulated dropouts; and the second sum against the protocol's own integer sum, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from fedswarm.algorithms.privacy.distributed import node_rng
from fedswarm.algorithms.secagg import run_round
from tests.test_batched import same_models_on_both_engines

KEYS = ("participants", "dropped_after_sharing", "recovered", "threshold", "degree", "field_bits")
#: seed 3, dropout 0.3, 8 clients: round 1 recovers a node in each sum, round 2's first sum fails past the
#: threshold (no second sum), round 3's second sum fails (found on the batched engine; both engines agree below)
RUN = dict(task="digits-mlp", clients=8, rounds=3, seed=3, local_epochs=1, secagg=True, secagg_dropout=0.3,
           secagg_threshold=0.51, strategy="sketched_sgd", params={"density": 0.05})


def _same_sums(rounds) -> None:
    """Both engines' rows: the same failures and the same membership figures of each sum."""
    for ref, got in rounds:
        assert ref.get("secagg_failed") == got.get("secagg_failed")
        for key in ("secagg", "secagg_values"):
            assert (key in ref) == (key in got), key
            if key in ref and "failed" not in ref[key]:
                assert {k: ref[key][k] for k in KEYS} == {k: got[key][k] for k in KEYS}, key
                assert ref[key]["nodes"]["masked_input"] == got[key]["nodes"]["masked_input"]


def test_batched_sketched_sgd_secure_rounds_equal_the_in_process_protocol_with_dropouts(tmp_path, monkeypatch):
    # to 1e-3 as the other batched secure rounds (tests/test_batched_secagg_engine.py says why: stochastic
    # rounding keyed by the protocol's random round id in-process)
    _, _, rounds = same_models_on_both_engines(RUN, tmp_path, monkeypatch, atol=1e-3)
    _same_sums(rounds)
    (r1, _), (r2, _), (r3, _) = rounds
    assert r1["secagg"]["recovered"] == 1 and r1["secagg_values"]["recovered"] == 1
    assert "failed" in r2["secagg"] and "secagg_values" not in r2  # no tables: no candidates to ask about
    assert "failed" in r3["secagg_values"] and r3["secagg_failed"] == r3["secagg_values"]["failed"]
    assert r1["secagg_values"]["participants"] == r1["secagg"]["nodes"]["masked_input"]  # the first sum's senders


def test_batched_sketched_sgd_secure_rounds_with_distributed_dp_equal_the_in_process_protocol(tmp_path, monkeypatch):
    kw = {**RUN, "rounds": 1, "dp": "noise_multiplier=0.5,clip=1.0"}
    _, _, rounds = same_models_on_both_engines(kw, tmp_path, monkeypatch, atol=1e-3)
    _same_sums(rounds)
    for ref, got in rounds:  # the same two releases reached the sum: the same accounting
        assert ref["epsilon"] == pytest.approx(got["epsilon"]) and got["epsilon"] > 0
        assert "secagg_values" in got and ref["train_loss"] is None and got["train_loss"] is None


def test_the_batched_second_sum_is_the_protocols_integer_sum_bit_for_bit(tmp_path, monkeypatch):
    """The values the batched exchange reads from each asked node's own reply (payload_of, the
    in-process node's reader) summed directly (SecureRound.total on the second sum's rounding
    stream) against the same values summed by the protocol itself (run_round: masks, shares,
    recovery) with the same dropouts, weights and graph; round 1 of RUN, a recovered node."""
    from fedswarm.sim import batched_secagg_round as sr
    from tests.test_batched import _models

    seen = []
    finish = sr.SecureRounds.finish

    def spy(self, rnd, rows, weights, server_round, **kw):
        out, row = finish(self, rnd, rows, weights, server_round, **kw)
        if kw.get("stream") == 1 and out is not None:
            seen.append((rnd, dict(rows), dict(weights), server_round, out))
        return out, row

    monkeypatch.setattr(sr.SecureRounds, "finish", spy)
    _models(__import__("fedswarm.config", fromlist=["RunConfig"]).RunConfig(engine="batched", **{**RUN, "rounds": 1}),
            tmp_path, monkeypatch)
    (rnd, rows, weights, server_round, out), = seen
    senders = sorted(out.senders)
    # the round's nodes (the first sum's senders); one lost before the masked-input stage was never asked
    dim = next(iter(rows.values())).size
    updates = {i: rows.get(i, np.zeros(dim)) for i in rnd.ids}
    assert set(rows) < set(updates)
    protocol = run_round(updates, rnd.server.params, weights={i: weights.get(i, 1) for i in rnd.ids}, drop=rnd.drop,
                         graph_seed=rnd.server.graph_seed,
                         rngs={i: node_rng(RUN["seed"], server_round, i, 1) for i in rnd.ids})
    assert out.report.recovered == protocol.report.recovered == 1
    assert sorted(protocol.encoded) == senders
    assert out.total.dtype == protocol.total.dtype == np.uint64 and np.array_equal(out.total, protocol.total)
    assert np.abs(protocol.decoded.weighted_sum).max() > 0  # a real sum, not zeros
