"""A compressed strategy's planned round (``plan_train`` -> ``TrainPlan``, what ``--engine batched``
reads instead of built messages): each node's message, built when read, holds what the per-node
path writes for it (``ReplicaSync.write`` with its version's body, its pending selection), and the
client step's view of it (``config_records``) reads as that message's records."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict

from fedswarm.algorithms.compression.codecs import make_codec
from fedswarm.params import ParamLayout
from fedswarm.server.metered_grid import serialized_size
from fedswarm.sim.batched_round import NodeIds
from fedswarm.strategies.federated.compressed_base import KNOBS, SELECT
from fedswarm.strategies.federated.compressed_fedavg import CompressedFedAvg

D = 400
LAYOUT = ParamLayout.from_shapes([("w", (D,))])


def _strategy(coded: str) -> CompressedFedAvg:
    """A strategy two versions in (the second coded with ``coded``), its nodes holding different
    versions (or none), two of them owed a selection."""
    gen = torch.Generator().manual_seed(0)
    strategy = CompressedFedAvg(LAYOUT, codec="topk", codec_params={"ratio": 0.1})
    strategy._ensure_model(ArrayRecord({"w": Array(np.zeros(D, dtype=np.float32))}))
    sparse = torch.zeros(D)
    sparse[[1, 50, 399]] = torch.tensor([0.5, -1.0, 2.0])
    strategy.sync.commit(sparse)  # version 1: three coordinates, no payload (a "sparse" body from 0)
    # version 2, coded: two coordinates (a "sparse" body from 0 and 1), or every one's sign (replaying
    # its payload, an "updates" body, is cheapest from 1)
    codec = make_codec("topk", ratio=0.005) if coded == "topk" else make_codec("sign")
    payload = codec.encode(torch.randn(1, D, generator=gen), LAYOUT)
    strategy.sync.commit(codec.decode(payload, LAYOUT)[0], payload)
    strategy.sync.nodes = {1: 0, 2: 1, 3: 2, 5: 2, 6: 0, 200: 1}  # 4 and 7..: no replica
    strategy.pending = {2: (3, "mask", b"\x05\x01"), 6: (2, "indices", b"\x01\x00\x00\x00\x07\x00\x00\x00"),
                        9: (3, "mask", b"\x03")}
    return strategy


@pytest.mark.parametrize("coded, modes", [("topk", {"full", "sparse", "none"}), ("sign", {"full", "updates", "none"})])
def test_a_planned_round_writes_each_node_what_the_per_node_path_writes(coded, modes):
    strategy, oracle = _strategy(coded), _strategy(coded)
    oracle.sync = copy.deepcopy(strategy.sync)  # one epoch (a fresh sync draws its own)
    random.seed(4)
    plan = strategy.plan_train(1, strategy.model_arrays(), ConfigRecord({"lr": 0.1}), NodeIds(300))
    assert len(plan) == 300 and sorted(plan.node_ids) == list(range(1, 301))
    assert strategy.round == 1
    seen = set()
    for k, nid in enumerate(plan.node_ids):
        # the per-node path: the config and knobs, ReplicaSync.write, the pending selection
        content = RecordDict({"config": plan.config, KNOBS: plan.knobs})
        oracle.sync.write(content, nid)
        if nid in oracle.pending:
            rnd, kind, data = oracle.pending[nid]
            content[SELECT] = ConfigRecord({"round": rnd, kind: data})
        want = Message(content=content, message_type=strategy.message_type, dst_node_id=nid)
        got = plan[k]
        assert got is plan[k]  # built once
        assert list(got.content.keys()) == list(want.content.keys())
        for key in want.content.keys():
            a, b = got.content[key], want.content[key]
            if isinstance(b, ArrayRecord):
                assert list(a.keys()) == list(b.keys())
                assert all(np.array_equal(a[n].numpy(), b[n].numpy()) for n in b.keys())
            else:
                assert dict(a) == dict(b), (nid, key)
        assert serialized_size(plan.fresh(k)) == serialized_size(want)
        view = plan.config_records(k)  # the client step's reading: the knobs and the selection's values
        assert view[KNOBS] is plan.knobs
        assert (dict(view[SELECT]) if SELECT in view else None) == (
            dict(want.content.config_records[SELECT]) if SELECT in want.content.config_records else None)
        seen.add(want.content.config_records["sync"]["mode"])
    assert seen == modes  # every kind of body this state has was compared
    assert strategy.sync.sent == oracle.sync.sent  # every node is sent the current version
