"""Exact resume where the nodes keep their own state (a deployment that survives its ServerApp).

A deployment resume and a resumed run on Flower's engine are new Flower runs: the nodes'
``Context.state`` starts empty. The nodes save it to their own disk after every round
(fedswarm.client.persist) and the resumed server asks them for the checkpoint's round
(fedswarm.server.client_state). Here, with the server checkpointing every 2 rounds and dying
after round 3's client updates (so every node holds a snapshot of round 3, newer than the
checkpoint's round 2):

- the resumed run ends with the uninterrupted run's model (1e-5), every round recorded once,
  for compressed_fedavg with error feedback (residual + replica) and for dpsgd (each node's
  own model): on the in-process engine with its client-state checkpoint taken away (the
  nodes' Context.state is then only on their disks, as on SuperNodes), and on Flower's engine;
- a node whose snapshot is gone is resynchronised by the protocol and named in a
  ``client_resync`` event; the round loses no update (no "replica out of step"), and the
  model then differs from the uninterrupted one (the loss is real).
"""

from __future__ import annotations

import pytest
import torch

from fedswarm.client.state_store import STATE_DIR_ENV, ClientStateStore
from fedswarm.config import RunConfig
from fedswarm.server.checkpoint import load_latest
from fedswarm.server.resume import prepare_resume
from fedswarm.sim.inprocess import InProcessGrid
from fedswarm.sim.run import run_engine
from fedswarm.store import Store
from fedswarm.wire import arrayrecord_to_vector

CASES = {
    "compressed_fedavg": {"params": {"codec": "topk", "error_feedback": True}},
    "dpsgd": {"topology": "ring"},
}


class Crash(Exception):
    """Stands for the server dying after round 3's client updates, before a checkpoint."""


def _crash_after_3(rnd: int, _row: dict) -> None:
    if rnd == 3:
        raise Crash("after round 3")


def _cfg(name: str, **extra) -> RunConfig:
    values = {"strategy": name, "clients": 4, "rounds": 5, "local_steps": 2, "seed": 3, "checkpoint_every": 2,
              **CASES[name], **extra}
    return RunConfig.build(values)


def _model(store: Store, rid: str) -> torch.Tensor:
    return arrayrecord_to_vector(load_latest(store, rid).arrays)


def _reference(name: str, store: Store) -> str:
    cfg = _cfg(name)
    rid = store.create_run(cfg.model_dump())
    assert run_engine(cfg, store=store, run_id=rid) == "finished"
    return rid


def _crash_and_resume(cfg: RunConfig, store: Store, state_dir, before_resume=None) -> str:
    rid = store.create_run(cfg.model_dump())
    with pytest.raises(Crash):
        run_engine(cfg, store=store, run_id=rid, listeners=[_crash_after_3])
    assert [r.round for r in store.rounds(rid)] == [0, 1, 2, 3]
    for p in range(cfg.clients):  # every node is a round ahead of the server's checkpoint
        assert ClientStateStore(state_dir, rid, p).rounds()[-1] == 3
    if cfg.engine != "flower":
        store.update_run(rid, engine="deployment")  # nodes that keep their own state, as SuperNodes do
    cfg2, ck = prepare_resume(store, rid)  # no --accept-client-state-loss needed
    assert ck.round == 2 and ck.grid is None
    if before_resume is not None:
        before_resume(rid)
    assert run_engine(cfg2, store=store, run_id=rid, resume=ck) == "finished"
    assert [r.round for r in store.rounds(rid)] == [0, 1, 2, 3, 4, 5]
    return rid


@pytest.fixture
def nodes_keep_state(tmp_path, monkeypatch):
    """The in-process engine without its client-state checkpoint: its virtual nodes then keep
    their Context.state on disk only (under $FEDSWARM_STATE_DIR), as SuperNodes do."""
    monkeypatch.setattr(InProcessGrid, "state_dict", None)
    monkeypatch.setenv(STATE_DIR_ENV, str(tmp_path / "state"))
    return tmp_path / "state"


@pytest.mark.parametrize("name", sorted(CASES))
def test_nodes_restore_their_own_state_and_the_resume_is_exact(name, tmp_path, nodes_keep_state):
    store = Store(tmp_path / "store.db")
    ref = _reference(name, store)
    rid = _crash_and_resume(_cfg(name), store, nodes_keep_state)
    torch.testing.assert_close(_model(store, rid), _model(store, ref), rtol=0, atol=1e-5)
    (event,) = [e for e in store.events(rid) if e.kind == "resumed"]
    assert "restored from the nodes' own disks on 4 of 4 nodes" in event.message and "LOST" not in event.message
    assert event.data["resynchronised_nodes"] == [] and event.data["client_state_lost"] is None
    assert not [e for e in store.events(rid) if e.kind == "client_resync"]
    assert not [n for n in store.node_rounds(rid) if n.status != "ok"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_node_without_its_state_is_resynchronised_by_name(name, tmp_path, nodes_keep_state):
    store = Store(tmp_path / "store.db")
    ref = _reference(name, store)

    def lose_partition_1(rid: str) -> None:
        folder = ClientStateStore(nodes_keep_state, rid, 1).folder
        (folder / "round-00000002.state").write_bytes(b"garbage")  # refused: the node has no state

    rid = _crash_and_resume(_cfg(name), store, nodes_keep_state, before_resume=lose_partition_1)
    (resync,) = [e for e in store.events(rid) if e.kind == "client_resync"]
    assert "(partition 1) has no state of round 2" in resync.message and resync.data["partition"] == 1
    (event,) = [e for e in store.events(rid) if e.kind == "resumed"]
    assert "on 3 of 4 nodes" in event.message and "partition 1" in event.message
    assert not [n for n in store.node_rounds(rid) if n.status != "ok"]  # no "replica out of step"
    assert (_model(store, rid) - _model(store, ref)).abs().max() > 1e-5  # partition 1's state was really lost


def test_a_node_that_joins_after_the_resume_query_is_named_once(tmp_path):
    """A node first seen after the resume query restored nothing (it was not asked): it is
    named once in a client_resync event; nodes that were asked, and runs not resumed, are not."""
    from fedswarm.server.recorder import RoundRecorder

    store = Store(tmp_path / "store.db")
    rid = store.create_run(RunConfig(rounds=3).model_dump())
    rec = RoundRecorder(store, rid, None, lambda flat: (0.0, 0.0))  # type: ignore[arg-type]
    assert rec.late_nodes(1, [{"node_id": "7"}]) == []  # not a resumed run
    rec.resume_asked, rec.resume_round = {"1", "2"}, 3
    assert rec.late_nodes(4, [{"node_id": "1"}, {"node_id": "9", "status": "ok"}]) == ["9"]
    assert rec.late_nodes(5, [{"node_id": "9"}, {"node_id": "2"}]) == []
    (event,) = [e for e in store.events(rid) if e.kind == "client_resync"]
    assert "node 9 joined after the resume query (first seen in round 4)" in event.message
    assert event.data == {"node_id": "9", "round": 3, "late": True, "first_round": 4}


def test_the_recorder_names_a_late_node_from_a_rounds_replies(tmp_path):
    """The recorder's own round (not late_nodes called by hand): a reply from a node the
    resume query never asked gives one client_resync event; the asked node's reply none."""
    from flwr.app import Message, MetricRecord, RecordDict

    from fedswarm.server.metered_grid import Traffic
    from fedswarm.server.recorder import RoundRecorder

    def reply_from(node: int) -> Message:
        sent = Message(RecordDict({}), dst_node_id=node, message_type="train")
        reply = Message(RecordDict({"metrics": MetricRecord({"num-examples": 5, "train_loss": 0.5})}), reply_to=sent)
        reply.metadata.__dict__["_src_node_id"] = node
        return reply

    class Grid:
        def take(self):
            return Traffic(replies=[reply_from(1), reply_from(9)])

    store = Store(tmp_path / "store.db")
    rid = store.create_run(RunConfig(rounds=3).model_dump())
    rec = RoundRecorder(store, rid, Grid(), lambda flat: (0.0, 0.0))  # type: ignore[arg-type]
    rec.resume_asked, rec.resume_round, rec.offset = {"1"}, 2, 2
    rec(1, None)  # type: ignore[arg-type]  # round 3 of the run
    (event,) = [e for e in store.events(rid) if e.kind == "client_resync"]
    assert event.data == {"node_id": "9", "round": 2, "late": True, "first_round": 3}
    assert sorted(n.node_id for n in store.node_rounds(rid)) == ["1", "9"]


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", sorted(CASES))
def test_flower_engine_resume_is_exact(name, tmp_path, monkeypatch):
    """The same on Flower's simulation engine (Ray actors; new node ids after the resume):
    compared with the uninterrupted run on the in-process engine (same seed, same model)."""
    monkeypatch.setenv(STATE_DIR_ENV, str(tmp_path / "state"))
    store = Store(tmp_path / "store.db")
    ref = _reference(name, store)
    rid = _crash_and_resume(_cfg(name, engine="flower"), store, tmp_path / "state")
    torch.testing.assert_close(_model(store, rid), _model(store, ref), rtol=0, atol=1e-5)
    (event,) = [e for e in store.events(rid) if e.kind == "resumed"]
    assert "restored from the nodes' own disks on 4 of 4 nodes" in event.message
