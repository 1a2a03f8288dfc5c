"""Linear codecs under secure aggregation on the in-process engine (strategies/secagg_payload.py):
FetchSGD's nodes mask their Count Sketch tables and the server unsketches the unmasked mean
table; compressed_fedavg's nodes mask their randk values or countsketch table and the server
decodes the mean payload once."""

from __future__ import annotations

import numpy as np
import pytest

from fedswarm.algorithms.secagg import SecAggParams, SecAggServer
from fedswarm.server.secagg import is_train
from tests import test_secagg_flower as flower

SKETCH = dict(strategy="fetchsgd", clients=4, seed=7)


class TrainCapture(flower.CaptureGrid):
    """Keeps the train rounds' messages and replies (fedswarm's ``train.<strategy>`` type)."""

    def send_and_receive(self, messages, *, timeout=None):
        msgs = list(messages)
        replies = list(self.inner.send_and_receive(msgs, timeout=timeout))
        if any(is_train(m) for m in msgs):
            self.sent += msgs
            self.received += replies
        return replies


@pytest.fixture
def capture(monkeypatch):
    monkeypatch.setattr(flower, "CaptureGrid", TrainCapture)


def test_fetchsgd_secure_round_matches_the_plain_one_within_quantization_error(store, capture):
    _, plain_id, st1, plain_grid, _ = flower._run(store, **SKETCH)
    cfg, sec_id, st2, _, _ = flower._run(store, **SKETCH, secagg=True)
    assert st1 == st2 == "finished"
    plain, secure = flower._model(store, plain_id), flower._model(store, sec_id)
    tables = [r.content.array_records["payload"]["table"].numpy() for r in plain_grid.received]
    assert len(tables) == cfg.clients
    assert max(np.abs(t).max() for t in tables) < cfg.secagg_clip  # no cell clipped: the same sum, quantized
    weights = [int(r.content.metric_records["metrics"]["num-examples"]) for r in plain_grid.received]
    q = SecAggServer(list(range(1, cfg.clients + 1)), tables[0].size, SecAggParams(bits=cfg.secagg_bits)).quantizer
    cell = cfg.clients / (sum(weights) * q.scale)  # one rounding unit per node in the mean table
    # One round: the update is server_lr * unsketch(mean table) at its top k (same support unless a
    # near-tie flips): each value a median of cells, so off by at most one cell's error.
    gap = np.max(np.abs(secure - plain))
    assert 0 < gap <= cell + 1e-6, (gap, cell)
    row = flower._rows(store, sec_id)[1]
    assert row["secagg"]["nodes"]["unmask"] == cfg.clients and "secagg_failed" not in row
    # every byte up is a stage's: the tables crossed the grid masked, never in the clear
    assert row["bytes_up"] == sum(s["up"] for s in row["secagg"]["bytes"].values())


def test_fetchsgd_under_secure_aggregation_on_digits_within_one_point(store):
    """The issue's figure: FetchSGD with and without secure aggregation, same seed and compression."""
    run = dict(strategy="fetchsgd", clients=5, seed=3, rounds=10, params={"density": 0.05})
    _, plain_id, st1, _, _ = flower._run(store, **run)
    _, sec_id, st2, _, _ = flower._run(store, **run, secagg=True)
    assert st1 == st2 == "finished"
    plain, secure = (flower._rows(store, r)[-1]["test_accuracy"] for r in (plain_id, sec_id))
    assert plain > 0.8  # it learned: the comparison means something
    assert abs(secure - plain) <= 0.01, (plain, secure)
    assert all("secagg_failed" not in r for r in flower._rows(store, sec_id))


def test_fetchsgd_with_secagg_and_dp_runs_with_epsilon_every_round_and_without_secagg_is_refused(store):
    from fedswarm.config import RunConfig
    from fedswarm.errors import ConfigError
    from fedswarm.params import ParamLayout
    from fedswarm.server.app import build_strategy
    from fedswarm.tasks import get_task

    dp = "noise_multiplier=0.3,clip=1.0"
    _, rid, status, _, _ = flower._run(store, strategy="fetchsgd", clients=4, seed=3, rounds=2, secagg=True, dp=dp,
                                       params={"density": 0.05})
    assert status == "finished"
    rows = flower._rows(store, rid)[1:]
    eps = [r.get("epsilon") for r in rows]
    assert len(eps) == 2 and None not in eps and eps[0] < eps[1]
    assert all("secagg_failed" not in r for r in rows)
    # without --secagg FetchSGD's server would see each table: central DP-FedAvg cannot bound it there
    cfg = RunConfig(**{**flower.BASE, "strategy": "fetchsgd", "dp": dp})
    with pytest.raises(ConfigError, match="does not support --dp"):
        build_strategy(cfg, ParamLayout.from_module(get_task(cfg.task).model(cfg.seed)))


@pytest.mark.parametrize("codec", ["countsketch", "randk"])
def test_compressed_fedavg_secure_round_is_the_decoded_mean_payload(store, capture, codec):
    """The server decodes the weighted mean payload once. The oracle, from the plain run's own
    replies: plain model - mean of the decoded payloads + decode(mean payload). For randk
    (decoding is a scatter: linear) the two runs agree; for countsketch (sketched top-k) the
    secure round is the top-k of the summed sketch, as in FetchSGD."""
    from fedswarm.algorithms.compression.codecs import decode_payload
    from fedswarm.params import ParamLayout
    from fedswarm.payload import Payload
    from fedswarm.tasks import get_task
    from fedswarm.wire import payload_from_records

    run = dict(strategy="compressed_fedavg", clients=4, seed=5,
               params={"codec": codec, "codec_params": "k_ratio=0.05" if codec == "countsketch" else "ratio=0.1"})
    cfg, plain_id, st1, plain_grid, _ = flower._run(store, **run)
    _, sec_id, st2, _, _ = flower._run(store, **run, secagg=True)
    assert st1 == st2 == "finished"
    layout = ParamLayout.from_module(get_task(cfg.task).model(cfg.seed))
    payloads = [payload_from_records(r.content) for r in plain_grid.received]
    (key,) = payloads[0].arrays
    counts = np.array([float(r.content.metric_records["metrics"]["num-examples"]) for r in plain_grid.received])
    w = counts / counts.sum()
    mean_arr = sum(wi * p.arrays[key].astype(np.float64) for wi, p in zip(w, payloads))
    assert max(np.abs(p.arrays[key]).max() for p in payloads) < cfg.secagg_clip  # nothing clipped
    decoded_mean = decode_payload(Payload({key: mean_arr.astype(np.float32)}, payloads[0].meta), layout)[0].double()
    mean_decoded = sum(wi * decode_payload(p, layout)[0].double() for wi, p in zip(w, payloads))
    plain, secure = flower._model(store, plain_id), flower._model(store, sec_id)
    expected = plain - mean_decoded.numpy() + decoded_mean.numpy()
    q = SecAggServer(list(range(1, cfg.clients + 1)), mean_arr.size, SecAggParams(bits=cfg.secagg_bits)).quantizer
    cell = cfg.clients / (counts.sum() * q.scale)  # one rounding unit per node in the mean payload
    f32 = 1e-6  # the models are float32 (|x| < 8)
    assert np.abs(plain).max() < 8
    gap = np.max(np.abs(secure - expected))
    assert gap <= cell + f32, (gap, cell)
    if codec == "countsketch":  # the decode of the sum is not the sum of decodes: the runs differ
        assert np.max(np.abs(secure - plain)) > 100 * (cell + f32)
    else:
        assert np.max(np.abs(secure - plain)) <= cell + f32
    assert "secagg_failed" not in flower._rows(store, sec_id)[1]


def test_sketched_sgd_runs_its_exact_values_as_a_second_secure_sum(store, capture):
    """Sketched-SGD's second exchange (each node's exact values at the server's shared
    candidates) is linear: under --secagg it runs as a second secure sum, each node's values
    weighted by its sketch's examples. One round matches the plain one within one rounding unit
    per node (the update is the exact mean values at the top k: the same support, each value off
    by at most a cell), and nothing of a node's table or values crosses the grid in the clear."""
    run = dict(strategy="sketched_sgd", clients=5, seed=3, params={"density": 0.05})
    cfg, plain_id, st1, plain_grid, _ = flower._run(store, **run)
    _, sec_id, st2, sec_grid, _ = flower._run(store, **run, secagg=True)
    assert st1 == st2 == "finished"
    plain, secure = flower._model(store, plain_id), flower._model(store, sec_id)
    weights = [int(r.content.metric_records["metrics"]["num-examples"]) for r in plain_grid.received
               if "payload" in r.content.array_records]  # the sketches (phase 2 replies say 0)
    assert len(weights) == cfg.clients
    q = SecAggServer(list(range(1, cfg.clients + 1)), 1, SecAggParams(bits=cfg.secagg_bits)).quantizer
    cell = cfg.clients / (sum(weights) * q.scale)  # one rounding unit per node in the mean values
    gap = np.max(np.abs(secure - plain))
    assert 0 < gap <= cell + 1e-6, (gap, cell)
    masked = [r for r in sec_grid.received if "secagg" in r.content.array_records]
    assert len(masked) == 2 * cfg.clients  # two secure sums in the round: the tables, then the values
    assert not any({"payload", "values"} & set(r.content.array_records) for r in sec_grid.received)
    assert "secagg_failed" not in flower._rows(store, sec_id)[1]
