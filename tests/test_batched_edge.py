"""The batched engine serves PVT: every round's global model equals the in-process
engine's to 1e-5, bytes up equal to the byte, for the default fraction, a class policy's
``pvt_fraction`` with other local steps, momentum, ids re-derived from the seed, sampling."""

import pytest

from tests.test_batched import same_models_on_both_engines

CASES = {
    "pvt": dict(clients=10, rounds=3, local_steps=3, fraction=0.6),
    "pvt-momentum-no-ids": dict(clients=8, rounds=2, local_steps=4, momentum=0.9, lr=0.05,
                                params={"fraction": 0.5, "send_ids": False, "server_lr": 0.5}),
    "pvt-class-policy": dict(clients=8, rounds=2, local_steps=2, devices="gpu:4,edge-wifi:4",
                             policies={"edge-wifi": {"pvt_fraction": 0.75, "local_steps": 5, "batch_size": 8}}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_batched_serves_pvt(case, tmp_path, monkeypatch):
    kw = {"strategy": "pvt", **CASES[case]}
    _, got_res, pairs = same_models_on_both_engines(kw, tmp_path, monkeypatch)
    for r_ref, r_got in pairs:
        assert r_got["num_clients"] == r_ref["num_clients"]
        assert r_got["train_loss"] == pytest.approx(r_ref["train_loss"], abs=1e-5)
        assert r_got["bytes_up"] == r_ref["bytes_up"]
        assert r_got["coverage"] == pytest.approx(r_ref["coverage"])
        # the train message's config names the engine: 'batched' is 2 bytes shorter than 'inprocess'
        assert r_ref["bytes_down"] - r_got["bytes_down"] == 2 * r_ref["num_clients"]
