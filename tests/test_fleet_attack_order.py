"""The order a ``--byzantine`` attack reads a round's replies in, under the fleet options: the order the
messages were sent (the strategy's sampled order), never a ``set``'s. An attack that draws (``gaussian``,
``random``) gives each attacker its draw by that order, so the same seed gives the same model run after run
in-process, and the batched engine, which attacks in the sampled order, gives the same model too
(tests/test_batched_fleet.py's ``*2-*`` cases)."""

from __future__ import annotations

import torch
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

from fedswarm.algorithms.robust.attacks import parse_attack
from fedswarm.config import RunConfig
from fedswarm.server.byzantine import ByzantineGrid
from fedswarm.strategies.strategy_utils import pull_replies
from fedswarm.wire import arrayrecord_to_vector, vector_to_arrayrecord
from tests.test_batched import _models


class _Nodes:
    """A grid of nodes 1..n, each replying with the model it was sent plus its node id; ``pull_messages``
    answers in the order asked, or, with ``reverse``, in the opposite one (as replies arrive on Ray or in a
    deployment, not as they were sent)."""

    def __init__(self, n: int, *, reverse: bool = False):
        self.n, self.reverse = n, reverse
        self.queue: dict[str, Message] = {}
        self.asked: list[list[str]] = []

    def get_node_ids(self):
        return list(range(1, self.n + 1))

    def push_messages(self, messages):
        ids = []
        for i, m in enumerate(messages):
            mid = f"m{len(self.queue) + i}"
            m.metadata.__dict__["_message_id"] = mid
            self.queue[mid] = m
            ids.append(mid)
        return ids

    def pull_messages(self, message_ids):
        asked = list(message_ids)
        self.asked.append(asked)
        out = []
        for mid in asked:
            m = self.queue.pop(mid)
            nid = m.metadata.dst_node_id
            x = arrayrecord_to_vector(m.content.array_records["arrays"]) + float(nid)
            reply = Message(RecordDict({"arrays": vector_to_arrayrecord(x), "metrics": MetricRecord({"n": 1})}),
                            reply_to=m)
            reply.metadata.__dict__["_src_node_id"] = nid
            out.append(reply)
        return out[::-1] if self.reverse else out


def _train(nodes: list[int], model: torch.Tensor) -> list[Message]:
    shared = vector_to_arrayrecord(model)
    return [Message(RecordDict({"arrays": shared, "config": ConfigRecord({"x": 1})}), dst_node_id=n,
                    message_type="train") for n in nodes]


def test_pull_replies_asks_in_the_order_given():
    """The ids still missing are asked for in the caller's order (the fleet grid's: the order sent), so a
    grid that answers in the order asked hands the replies back in it."""
    grid = _Nodes(8)
    ids = list(grid.push_messages(_train([5, 2, 8, 1, 7, 3, 6, 4], torch.zeros(3))))
    order = [ids[i] for i in (3, 0, 7, 5, 1, 6, 2, 4)]  # neither sorted nor the order pushed
    replies = pull_replies(grid, order, timeout=1.0)
    assert grid.asked == [order]
    assert [r.metadata.reply_to_message_id for r in replies] == order


def test_the_attack_reads_the_replies_in_the_order_sent_whatever_order_they_come_in():
    """Every node attacks with gaussian noise: node ``sent[i]`` gets row i of the attack's draw (the
    generator the grid seeds, ``seed + 7919``), whether the inner grid answers in the order asked or in
    the opposite one; the replies go on in the order they came."""
    d, std, seed, sent = 5, 0.5, 11, [3, 1, 4, 2]
    model = torch.arange(d, dtype=torch.float32)
    draw = torch.randn((len(sent), d), generator=torch.Generator().manual_seed(seed + 7919)) * std
    want = {node: draw[i] for i, node in enumerate(sent)}
    for reverse in (False, True):
        inner = _Nodes(4, reverse=reverse)
        grid = ByzantineGrid(inner, parse_attack(f"gaussian:std={std}"), 4, seed=seed, layout=None)
        ids = list(grid.push_messages(_train(sent, model)))
        replies = list(grid.pull_messages(ids))
        came = [r.metadata.src_node_id for r in replies]
        assert came == (sent[::-1] if reverse else sent)  # (the inner grid's order, passed on)
        for r in replies:
            got = arrayrecord_to_vector(r.content.array_records["arrays"]) - model
            torch.testing.assert_close(got, want[r.metadata.src_node_id], rtol=0, atol=1e-6)


def test_the_same_seed_gives_the_same_model_in_process_under_a_gaussian_attack_by_two(tmp_path, monkeypatch):
    """Three in-process runs of one config (a quorum of 6 of 8 sampled nodes, two of them attacking with
    gaussian noise, unequal partitions so that which attacker draws which noise moves the weighted mean):
    the same model every round. Before, the attack's order followed a set of message ids and two runs of
    this config differed (max 0.33 on the final model)."""
    kw = dict(task="synthetic-logreg", seed=3, lr=0.5, clients=8, rounds=3, local_steps=1, fraction=1.0, quorum=6,
              devices="edge-wifi:6,cpu:2", partition="dirichlet:0.5", byzantine=2, attack="gaussian:std=1")
    runs = []
    for i in range(3):
        (tmp_path / str(i)).mkdir()
        models, result = _models(RunConfig(engine="inprocess", **kw), tmp_path / str(i), monkeypatch)
        runs.append(models)
        rounds = result["rounds"][1:]
        assert any(len(r.get("byzantine_nodes") or []) == 2 for r in rounds), rounds  # both attacked in a round
    assert len(runs[0]) == kw["rounds"] + 1 and not torch.equal(runs[0][0], runs[0][-1])
    for other in runs[1:]:
        for rnd, (a, b) in enumerate(zip(runs[0], other)):
            assert torch.equal(a, b), f"round {rnd}: max diff {(a - b).abs().max():.3g}"
