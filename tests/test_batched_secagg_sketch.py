"""``sketched_sgd --secagg`` on the batched engine (sim/batched_secagg_sketch.py): its round's two
secure sums (the tables, then the exact values at the candidates) computed directly, against the
in-process engine's real protocol (SecAggGrid and the nodes' secagg_mod), with and without --dp,
with simulated dropouts."""

from __future__ import annotations

import pytest

from tests.test_batched import same_models_on_both_engines

KEYS = ("participants", "dropped_after_sharing", "recovered", "threshold", "degree", "field_bits")
SKETCH = dict(strategy="sketched_sgd", params={"density": 0.05})


def _same_sums(rounds) -> None:
    for ref, got in rounds:
        assert ref.get("secagg_failed") == got.get("secagg_failed")
        for key in ("secagg", "secagg_values"):
            assert (key in ref) == (key in got), key
            if key in ref and "failed" not in ref[key]:
                assert {k: ref[key][k] for k in KEYS} == {k: got[key][k] for k in KEYS}, key
                assert ref[key]["nodes"]["masked_input"] == got[key]["nodes"]["masked_input"]


def test_try(tmp_path, monkeypatch):
    kw = dict(task="digits-mlp", clients=8, rounds=3, seed=6, local_epochs=1, secagg=True, secagg_dropout=0.3,
              secagg_threshold=0.51, **SKETCH)
    _, _, rounds = same_models_on_both_engines(kw, tmp_path, monkeypatch, atol=1e-3)
    for ref, got in rounds:
        print({k: ref.get(k) for k in ("secagg_failed", "secagg", "secagg_values")})
        print({k: got.get(k) for k in ("secagg_failed", "secagg", "secagg_values")})
    _same_sums(rounds)
