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
from tests.test_batched import same_models_on_both_engines
from tests.test_batched_secagg_engine import DROPOUT_RUN, same_secure_rounds

CASES = {
    "countsketch": dict(strategy="compressed_fedavg", params={"codec": "countsketch", "codec_params": "k_ratio=0.05"}),
    "randk": dict(strategy="compressed_fedavg", params={"codec": "randk", "codec_params": "ratio=0.1"}),
    "fetchsgd": dict(strategy="fetchsgd", params={"density": 0.05}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_batched_codec_secure_rounds_equal_the_in_process_protocol_with_dropouts(case, tmp_path, monkeypatch):
    # the FedAvg run's dropouts: a failed round, a recovered node (measured: 2.1e-6 at most; forgetting the
    # dropouts gives 0.073, training the nodes the masked-input stage never reached 0.025)
    same_secure_rounds({**DROPOUT_RUN, **CASES[case]}, tmp_path, monkeypatch)


@pytest.mark.parametrize("case", ["countsketch", "fetchsgd"])
def test_batched_codec_secure_rounds_with_distributed_dp_equal_the_in_process_protocol(case, tmp_path, monkeypatch):
    kw = dict(task="digits-mlp", clients=5, rounds=2, seed=1, local_epochs=1, secagg=True,
              dp="noise_multiplier=0.5,clip=1.0", **CASES[case])
    _, _, rounds = same_models_on_both_engines(kw, tmp_path, monkeypatch, atol=1e-3)  # as above
    for ref, got in rounds:  # the same noise reached the sum: the same accounting
        assert ref["epsilon"] == pytest.approx(got["epsilon"]) and got["epsilon"] > 0
        assert ref["train_loss"] is None and got["train_loss"] is None  # the DP noise covers the payload only


@pytest.mark.parametrize("codec,params", [("countsketch", {"k_ratio": 0.05}), ("randk", {"ratio": 0.1})])
def test_the_batched_payload_sum_is_the_protocols_integer_sum_bit_for_bit(codec, params):
    """Each client's one-row payload as the batched runner sends it (client_payload), masked in
    the batched layout (payload_vector) and summed directly (SecureRound), against the same
    payloads sent as real replies, read by the in-process node's payload_of and summed by the
    protocol itself (run_round: masks, shares, recovery), dropouts at every stage."""
    from flwr.app import Message, MetricRecord, RecordDict

    from fedswarm.algorithms.compression.codecs import make_codec
    from fedswarm.params import ParamLayout
    from fedswarm.sim.batched_compressed import client_payload
    from fedswarm.sim.batched_secagg import SecureRound
    from fedswarm.strategies.secagg_payload import payload_of, payload_vector
    from fedswarm.tasks import get_task
    from fedswarm.wire import payload_to_records

    layout = ParamLayout.from_module(get_task("digits-mlp").model(0))
    ids = [100 + i for i in range(10)]
    weights = {i: w for i, w in zip(ids, [3, 1, 7, 2, 2, 9, 4, 1, 5, 6])}
    seed, round_, graph = 5, 3, 1234
    deltas = torch.randn(len(ids), layout.d, generator=torch.Generator().manual_seed(0)) * 0.01
    batch = make_codec(codec, **params).encode(deltas, layout, seed=77)
    sent = {i: client_payload(batch, j, 77) for j, i in enumerate(ids)}
    replies = {}
    for i, p in sent.items():
        content = payload_to_records(p, RecordDict())
        content["metrics"] = MetricRecord({"num-examples": weights[i]})
        replies[i] = payload_of(Message(content, dst_node_id=i, message_type="train"))
    inprocess = {i: v for i, (v, w, _) in replies.items()}
    assert all(replies[i][1] == weights[i] for i in ids)
    dim = next(iter(inprocess.values())).size
    drop = {"advertise": {ids[0]}, "share_keys": {ids[3]}, "masked_input": {ids[5]}, "unmask": {ids[8]}}
    sa = SecAggParams(clip=0.05, bits=32, weight_max=16, threshold=0.6)
    protocol = run_round(inprocess, sa, weights=weights, drop=drop, graph_seed=graph,
                         rngs={i: node_rng(seed, round_, i) for i in ids})
    rnd = SecureRound(ids, dim, sa, graph_seed=graph, drop=drop)
    direct = rnd.total({i: payload_vector(p)[0] for i, p in sent.items()}, rnd.senders(), seed=seed, round_=round_,
                       weights=weights)
    assert direct.total.dtype == protocol.total.dtype == np.uint64
    assert np.array_equal(direct.total, protocol.total)
    assert direct.senders == set(protocol.encoded) and len(direct.senders) == 7  # an unmask dropout is in the sum
    assert direct.report.recovered == protocol.report.recovered == 1
    assert np.abs(protocol.decoded.weighted_sum).max() > 0  # a real sum, not zeros


def test_a_round_whose_survivors_payloads_differ_fails_as_the_in_process_server_fails_it():
    """A device-class policy that sends another linear codec: the survivors' payload specs differ,
    so their sum has no meaning; the round fails with the reason and the model stays."""
    from fedswarm.sim.batched_secagg_round import SecureRounds
    from fedswarm.strategies.secagg_payload import check_specs

    cfg = RunConfig(task="digits-mlp", clients=4, secagg=True)
    rounds = SecureRounds(cfg)
    rnd = rounds.begin([1, 2, 3, 4], 3)
    rows = {i: np.full(3, 0.01 * i) for i in (1, 2, 3, 4)}
    specs = {i: {"key": "values" if i < 4 else "table", "shape": [1, 3], "dtype": "float32", "meta": "{}"}
             for i in rows}
    out, row = rounds.finish(rnd, rows, {i: 1 for i in rows}, 1,
                             check=lambda senders: check_specs({n: specs[n] for n in senders}, 3))
    assert out is None and "payload specs differ" in row["secagg_failed"]
    assert row["secagg"]["failed"] == row["secagg_failed"]



def test_fedavg_under_secagg_on_ray_shards_is_refused_in_one_line():
    """Its shards send back sums, not the updates a secure sum takes (the codecs' payloads come back:
    tests/test_batched_ray.py runs them sharded)."""
    from fedswarm.sim.batched_ray import check_sharded

    with pytest.raises(ConfigError, match="a secure sum needs each node's update") as err:
        check_sharded(RunConfig(task="digits-mlp", engine="batched", ray_address="127.0.0.1:1", workers=2,
                                clients=4, secagg=True))
    assert "\n" not in str(err.value)
    check_sharded(RunConfig(task="digits-mlp", strategy="fetchsgd", engine="batched", ray_address="127.0.0.1:1",
                            workers=2, clients=4, secagg=True))
