"""``--engine batched --secagg`` with the linear codecs (sim/batched_secagg_codec.py):
compressed_fedavg (countsketch; randk with the round's shared coordinates) and fetchsgd, their
secure sum computed directly, against the in-process engine's real protocol (SecAggGrid and the
nodes' secagg_mod masking their payloads); and that sum against the protocol's own integer sum,
bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedswarm.algorithms.privacy.distributed import node_rng
from fedswarm.algorithms.secagg import SecAggParams, run_round
from fedswarm.config import RunConfig
from fedswarm.errors import ConfigError
from fedswarm.sim.engines import check_run
from tests.test_batched import same_models_on_both_engines

CASES = {
    "countsketch": dict(strategy="compressed_fedavg", params={"codec": "countsketch", "codec_params": "k_ratio=0.05"}),
    "randk": dict(strategy="compressed_fedavg", params={"codec": "randk", "codec_params": "ratio=0.1"}),
    "fetchsgd": dict(strategy="fetchsgd", params={"density": 0.05}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_batched_codec_secure_rounds_equal_the_in_process_protocol_with_dropouts(case, tmp_path, monkeypatch):
    # seed 6, dropout 0.3, 8 clients: round 1 fails past the threshold, round 3 recovers a node dropped after
    # sharing (as tests/test_batched_secagg_engine.py's FedAvg run). 1e-3: that test says why.
    kw = dict(task="digits-mlp", clients=8, rounds=3, seed=6, local_epochs=1, secagg=True, secagg_dropout=0.3,
              secagg_threshold=0.51, **CASES[case])
    _, _, rounds = same_models_on_both_engines(kw, tmp_path, monkeypatch, atol=1e-3)
    keys = ("participants", "dropped_after_sharing", "recovered", "threshold", "degree", "field_bits")
    for ref, got in rounds:
        assert ("secagg_failed" in ref) == ("secagg_failed" in got)
        if "secagg_failed" in ref:
            assert ref["secagg_failed"] == got["secagg_failed"]
            continue
        assert {k: ref["secagg"][k] for k in keys} == {k: got["secagg"][k] for k in keys}
        assert ref["secagg"]["nodes"]["masked_input"] == got["secagg"]["nodes"]["masked_input"]
    assert "secagg_failed" in rounds[0][1] and rounds[2][1]["secagg"]["recovered"] == 1
