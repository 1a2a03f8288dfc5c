"""Every strategy rejects a malformed reply through ``reject(reply, reason)`` and the run
store keeps it with its reason (the ``rejections`` table and the node's row); the typed
round notes reach the round's row; the dashboard's run page shows the rejections.

The server side is real (``run_server``: the registry's strategy, the MeteredGrid, the
RoundRecorder, a SQLite store); only the nodes are replaced by a grid whose every reply is
malformed: NaN values of the wrong size under every record name a strategy reads.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sqlalchemy.exc import OperationalError
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid

from fedswarm.config import RunConfig
from fedswarm.server.app import run_server
from fedswarm.store import Rejection, Store, migrate
from fedswarm.strategies import registry
from fedswarm.strategies.strategy_utils import ReportsRounds, RoundNotes, notes_for

NODES = (11, 12)


class MalformedGrid(Grid):
    """Nodes that answer every message with garbage (and nothing else)."""

    def __init__(self, nodes=NODES):
        self.nodes = list(nodes)
        self.asked: set[int] = set()  # nodes that were sent a message

    @property
    def run(self):
        raise NotImplementedError

    def set_run(self, run_id: int) -> None:
        pass

    def create_message(self, *args, **kwargs):
        raise NotImplementedError

    def get_node_ids(self):
        return list(self.nodes)

    def push_messages(self, messages):
        raise NotImplementedError

    def pull_messages(self, message_ids):
        raise NotImplementedError

    def send_and_receive(self, messages, *, timeout=None):
        replies = []
        for i, msg in enumerate(messages):
            self.asked.add(msg.metadata.dst_node_id)
            bad = ArrayRecord({"vector": Array(np.array([np.nan, 1.0, np.inf], dtype=np.float32))})
            content = RecordDict({
                "metrics": MetricRecord({"num-examples": 5, "train_loss": 0.5, "partition-id": i}),
                "arrays": bad, "message": bad, "model": bad, "update": bad, "payload": bad})
            reply = Message(content, reply_to=msg)
            replies.append(reply)
        return replies


def _flower_strategies() -> list[str]:
    """Every registered strategy the Flower ServerApp runs: not the ``async`` ones (A(D)-PSGD,
    Prague: the asynchronous simulator) nor the ``array`` ones (LSGD: the array engine and
    the swarm); those are no Flower strategies. Nor ``fedbuff``: it pushes and pulls with no round to
    end (a grid whose every reply is garbage never lets it fold one), tests/test_fedbuff.py checks its
    refusals."""
    return [e.name for e in registry.entries() if e.kind not in ("async", "array") and e.name != "fedbuff"]


CASES = _flower_strategies() + ["fedavg+dp", "compressed_fedavg+dp"]
SETTINGS = {  # what a strategy needs to run at all
    "progfed": {"task": "digits-cnn4"},
    "solon": {"clients": 3},  # P >= 2s + m workers
}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    torch.set_num_threads(1)
    s = Store(tmp_path_factory.mktemp("rej") / "s.db")
    yield s
    s.close()


@pytest.mark.parametrize("case", CASES)
def test_every_strategy_records_a_malformed_reply_with_its_reason(store, case):
    name, _, extra = case.partition("+")
    kw = {"clients": len(NODES), **SETTINGS.get(name, {})}
    if extra == "dp":
        kw["dp"] = "clip=1,noise_multiplier=0.5"
    cfg = RunConfig(strategy=name, rounds=1, seed=0, **kw)
    rid = store.create_run(cfg.model_dump())
    grid = MalformedGrid(range(11, 11 + cfg.clients))
    assert run_server(grid, cfg, store=store, run_id=rid) == "finished", store.get_run(rid).error
    assert grid.asked  # HL sends to one node a round, the others to all
    asked = {str(n) for n in grid.asked}
    rows = store.rejections(rid)
    assert {r.node_id for r in rows} == asked, [(r.node_id, r.reason) for r in rows]
    for r in rows:
        assert r.reason and r.reason != "rejected", r.reason  # a reason that names what is wrong
    nodes = [n for n in store.node_rounds(rid) if n.round >= 1]
    assert nodes and all(n.status == "rejected" and n.reason for n in nodes)
    last = store.export_result(rid)["rounds"][-1]
    assert last["rejected"] == len(asked) and set(last["rejected_reasons"]) == asked


def test_round_notes_are_typed_and_default_to_memory():
    class Plain:
        pass

    s = Plain()
    notes = notes_for(lambda rnd, arrays: None)  # a user's own evaluate_fn: notes stay in memory
    assert type(notes) is RoundNotes
    notes.note(a=1)
    notes.reject(3, "  first line\nsecond line")
    assert notes.take() == ({"a": 1}, {"3": "first line"})
    assert notes.take() == ({}, {})
    rec = RoundNotes()
    assert notes_for(rec) is rec
    assert not hasattr(s, "note")


def test_reject_marks_the_reply_and_notes_the_reason():
    class S(ReportsRounds):
        pass

    s, notes = S(), RoundNotes()
    s._notes = notes
    msg = Message(RecordDict({"metrics": MetricRecord({"num-examples": 3, "train_loss": 1.0})}), dst_node_id=7,
                  message_type="train")
    reply = Message(RecordDict({"metrics": MetricRecord({"num-examples": 3, "train_loss": 1.0})}), reply_to=msg)
    assert s.reject(reply, ValueError("bad size")) == "bad size"
    assert notes.take()[1] == {"7": "bad size"}
    assert reply.content.metric_records["metrics"]["rejected"] == 1
    assert "train_loss" not in reply.content.metric_records["metrics"]


def test_migrate_adds_the_rejections_table_to_an_old_store(tmp_path):
    s = Store(tmp_path / "old.db")
    Rejection.__table__.drop(s.engine)  # a store made before the table existed
    rid = s.create_run(RunConfig().model_dump())
    with pytest.raises(OperationalError, match="no such table"):
        s.add_rejections(rid, 1, {"1": "x"})
    migrate(s.engine)
    s.add_rejections(rid, 1, {"1": "too big"})
    assert [(r.node_id, r.reason) for r in s.rejections(rid)] == [("1", "too big")]
    s.close()
