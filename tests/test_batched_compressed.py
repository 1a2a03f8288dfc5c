"""The batched engine serves the compressed strategies: every round's global model equals
the in-process engine's to 1e-5 (same seed and config), bytes up equal to the byte, bytes
down equal but for the engine's name in the train config, for every codec, with and
without error feedback, with a downlink codec, 1-bit SGD, and a per-class codec policy."""

import pytest
import torch

from fedswarm.config import RunConfig
from tests.test_batched import _models

BASE = dict(clients=10, rounds=3, local_steps=2, fraction=0.6, lr=0.1)
CASES = {
    "topk-ef": dict(strategy="compressed_fedavg", params={"codec": "topk", "codec_params": "ratio=0.1"}),
    "topk-no-ef": dict(strategy="compressed_fedavg", params={"codec": "topk", "codec_params": "ratio=0.05",
                                                             "error_feedback": False}),
    "randk": dict(strategy="compressed_fedavg", params={"codec": "randk", "codec_params": "ratio=0.2"}),
    "qsgd": dict(strategy="compressed_fedavg", params={"codec": "qsgd"}),  # per-client seeds
    "sign": dict(strategy="compressed_fedavg", params={"codec": "sign"}),
    "onebit-codec": dict(strategy="compressed_fedavg", params={"codec": "onebit"}),
    "fp16": dict(strategy="compressed_fedavg", params={"codec": "fp16", "server_lr": 0.5}),
    "countsketch": dict(strategy="compressed_fedavg", params={"codec": "countsketch"}),
    "topk-downlink": dict(strategy="compressed_fedavg", params={"codec": "topk", "codec_params": "ratio=0.1",
                                                                "downlink_codec": "topk",
                                                                "downlink_codec_params": "ratio=0.2"}),
    "onebit": dict(strategy="onebit", clients=8, fraction=1.0, local_epochs=1, local_steps=None),
    "class-codec": dict(strategy="compressed_fedavg", clients=8, fraction=1.0,
                        params={"codec": "topk", "codec_params": "ratio=0.1"}, devices="gpu:4,edge-wifi:4",
                        policies={"edge-wifi": {"codec": "randk", "codec_params": {"ratio": 0.3},
                                                "local_steps": 3, "lr": 0.05}}),
    "logreg-topk": dict(strategy="compressed_fedavg", task="synthetic-logreg", clients=12, local_steps=1, lr=0.5,
                        params={"codec": "topk", "codec_params": "ratio=0.2"}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_batched_serves_compressed_strategies(case, tmp_path, monkeypatch):
    kw = {**BASE, **CASES[case]}
    kw = {k: v for k, v in kw.items() if v is not None}
    ref, ref_res = _models(RunConfig(engine="inprocess", **kw), tmp_path, monkeypatch)
    got, got_res = _models(RunConfig(engine="batched", **kw), tmp_path, monkeypatch)
    assert len(got) == len(ref) == kw["rounds"] + 1
    for rnd, (a, b) in enumerate(zip(ref, got)):
        assert torch.allclose(a, b, atol=1e-5, rtol=0), f"round {rnd}: max diff {(a - b).abs().max():.3g}"
    assert not torch.equal(ref[0], ref[-1])  # training moved the model
    for r_ref, r_got in zip(ref_res["rounds"][1:], got_res["rounds"][1:]):
        assert r_got["num_clients"] == r_ref["num_clients"]
        assert r_got["train_loss"] == pytest.approx(r_ref["train_loss"], abs=1e-5)
        assert r_got["bytes_up"] == r_ref["bytes_up"]
        # The train config names the engine ('batched' is 2 bytes shorter than 'inprocess'),
        # and each sync record carries a CRC-32 of the model: equal to 1e-5, not bit for bit,
        # the two models' CRCs differ and so may their varint lengths (1 to 5 bytes).
        extra = r_ref["bytes_down"] - r_got["bytes_down"] - 2 * r_ref["num_clients"]
        assert abs(extra) <= 4 * r_ref["num_clients"], extra
