"""Byzantine attacks: their math against numpy, their specs, and the grid that applies
them to chosen nodes' replies without telling the aggregator."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

from fedswarm.algorithms.robust.attacks import alie_z, parse_attack
from fedswarm.params import ParamLayout
from fedswarm.server.byzantine import BYZANTINE_RECORD, ByzantineGrid
from fedswarm.wire import arrayrecord_to_vector, vector_to_arrayrecord

G = torch.Generator().manual_seed(0)


def _honest(h=6, d=5, seed=0):
    return torch.from_numpy(np.random.default_rng(seed).normal(size=(h, d)).astype(np.float32))


def test_update_attacks_against_numpy():
    hon, own = _honest(), _honest(2, seed=1)
    h = hon.numpy().astype(np.float64)
    np.testing.assert_allclose(parse_attack("signflip:scale=10").apply(own, hon, 8, G).numpy(), -10 * own.numpy())
    np.testing.assert_allclose(parse_attack("ipm:eps=0.3").apply(own, hon, 8, G).numpy(),
                               np.tile(-0.3 * h.mean(axis=0), (2, 1)), rtol=1e-6)
    z = alie_z(8, 2)
    np.testing.assert_allclose(parse_attack("alie").apply(own, hon, 8, G).numpy(),
                               np.tile(h.mean(axis=0) - z * h.std(axis=0), (2, 1)), rtol=1e-5, atol=1e-6)
    vote = np.sign(np.sign(h).sum(axis=0))
    vote[vote == 0] = 1
    np.testing.assert_allclose(parse_attack("signvote").apply(own, hon, 8, G).numpy(),
                               np.tile(-vote * np.abs(h).mean(axis=0), (2, 1)), rtol=1e-6)
    noise = parse_attack("gaussian:std=2").apply(own, hon, 8, torch.Generator().manual_seed(1))
    assert noise.shape == own.shape and 0.5 < float(noise.std()) < 4


def test_alie_z_is_baruch_et_al():
    # n = 15, b = 3: s = floor(15/2 + 1) - 3 = 5 supporters, z = Phi^-1((15 - 5)/15)
    from statistics import NormalDist

    assert alie_z(15, 3) == pytest.approx(NormalDist().inv_cdf(10 / 15), rel=1e-9)
    assert alie_z(50, 12) == pytest.approx(NormalDist().inv_cdf((50 - (26 - 12)) / 50), rel=1e-9)


@pytest.mark.parametrize("bad,match", [("nope", "unknown attack"), ("signflip:sale=2", "unknown key .sale."),
                                       ("gaussian:std=-1", ">= 0"), ("ipm:eps=abc", "number"), ("", "NAME")])
def test_bad_attack_specs(bad, match):
    with pytest.raises(ValueError, match=match):
        parse_attack(bad)


class _FakeGrid:
    """A grid of n nodes whose 'clients' reply with the model they got plus a fixed change."""

    def __init__(self, n, d):
        self.n, self.d = n, d
        self.changes = {i + 1: torch.full((d,), float(i + 1)) for i in range(n)}
        self.seen: dict[int, Message] = {}

    def get_node_ids(self):
        return list(range(1, self.n + 1))

    def send_and_receive(self, messages, *, timeout=None):
        out = []
        for m in messages:
            nid = m.metadata.dst_node_id
            self.seen[nid] = m
            x = arrayrecord_to_vector(m.content.array_records["arrays"]) + self.changes[nid]
            reply = Message(RecordDict({"arrays": vector_to_arrayrecord(x),
                                        "metrics": MetricRecord({"num-examples": 1})}),
                            reply_to=m)
            reply.metadata.__dict__["_src_node_id"] = nid
            out.append(reply)
        return out


def _round(grid, d, model):
    shared = vector_to_arrayrecord(model)
    msgs = []
    for nid in range(1, 7):
        msgs.append(Message(RecordDict({"arrays": shared, "config": ConfigRecord({"x": 1})}), dst_node_id=nid,
                            message_type="train"))
    return msgs, grid.send_and_receive(msgs)


def test_grid_rewrites_only_the_chosen_nodes_and_reports_them():
    d, noted = 4, []
    inner = _FakeGrid(6, d)
    grid = ByzantineGrid(inner, parse_attack("signflip:scale=3"), 2, seed=5, layout=ParamLayout([]),
                         on_attack=lambda nodes, spec: noted.append((nodes, spec)))
    bad = grid.byzantine
    assert len(bad) == 2 and bad == ByzantineGrid(inner, parse_attack("ipm"), 2, seed=5, layout=None).byzantine
    model = torch.arange(d, dtype=torch.float32)
    _, replies = _round(grid, d, model)
    for r in replies:
        nid = r.metadata.src_node_id
        got = arrayrecord_to_vector(r.content.array_records["arrays"]) - model
        want = -3 * inner.changes[nid] if nid in bad else inner.changes[nid]
        np.testing.assert_allclose(got.numpy(), want.numpy())
    assert noted == [(bad, "signflip:scale=3.0")]
    # the messages the strategy built carry nothing about the attack
    assert all(BYZANTINE_RECORD not in m.content.config_records for m in inner.seen.values())


def test_data_poisoning_marks_only_byzantine_messages():
    inner = _FakeGrid(6, 3)
    grid = ByzantineGrid(inner, parse_attack("labelflip"), 2, seed=1, layout=None)
    msgs, _ = _round(grid, 3, torch.zeros(3))
    for nid, m in inner.seen.items():
        assert (BYZANTINE_RECORD in m.content.config_records) == (nid in grid.byzantine)


def test_random_bytes_attack_keeps_sizes():
    inner = _FakeGrid(6, 64)
    grid = ByzantineGrid(inner, parse_attack("random"), 3, seed=2, layout=None)
    _, replies = _round(grid, 64, torch.zeros(64))
    for r in replies:
        arr = r.content.array_records["arrays"]["vector"].numpy()
        assert arr.shape == (64,) and arr.dtype == np.float32
        honest = r.metadata.src_node_id not in grid.byzantine
        assert np.array_equal(arr, inner.changes[r.metadata.src_node_id].numpy()) == honest


def test_too_many_byzantine_is_refused():
    with pytest.raises(ValueError, match="7 Byzantine clients asked for, the federation has 6"):
        _ = ByzantineGrid(_FakeGrid(6, 2), parse_attack("ipm"), 7, seed=0, layout=None).byzantine
    assert math.isfinite(alie_z(3, 3))
