"""Per-device-class policies: a change between rounds takes effect in the next round and
is recorded with every node's row."""

import json

import pytest
from flwr.app import ConfigRecord, Message, RecordDict

from fedswarm.config import RunConfig
from fedswarm.errors import ConfigError
from fedswarm.params import get_flat
from fedswarm.policy import PolicyBook, device_class_of, policy_for
from fedswarm.sim.inprocess import InProcessGrid, run_inprocess
from fedswarm.tasks import get_task
from fedswarm.wire import vector_to_arrayrecord


def test_policy_book_folds_changes_and_validates():
    book = PolicyBook({"edge-lte": {"local_steps": 2}})
    assert book.update("edge-lte", {"lr": 0.05}) == {"local_steps": 2, "lr": 0.05}
    rec = ConfigRecord({"policy.stale": "{}", "task": "digits-mlp"})
    book.write(rec)
    assert "policy.stale" not in rec and json.loads(rec["policy.edge-lte"]) == {"local_steps": 2, "lr": 0.05}
    assert policy_for(rec, "edge-lte")["lr"] == 0.05 and policy_for(rec, "gpu") == {}
    with pytest.raises(ConfigError, match="'local_steps'"):
        book.update("gpu", {"local_steps": 0})
    with pytest.raises(ConfigError, match="allowed keys"):
        book.update("gpu", {"warp": 1})


def test_device_class_sources():
    assert device_class_of({"device-class": "jetson"}, "gpu:2", 0, 2) == "jetson"
    assert device_class_of({}, "gpu:1,edge-lte:2", 2, 3) == "edge-lte"
    assert device_class_of({}, None, 0, 3) == "default"


def test_client_applies_its_class_policy():
    cfg = RunConfig(clients=2, devices="gpu:1,edge-lte:1")
    from fedswarm.client.app import app

    grid = InProcessGrid(app, 2, run_config=cfg.to_flat())
    conf = ConfigRecord({k: v for k, v in cfg.to_flat().items() if k != "policies"})
    conf["server-round"] = 1
    PolicyBook({"edge-lte": {"local_steps": 1}, "gpu": {"local_steps": 7}}).write(conf)
    flat = get_flat(get_task(cfg.task).model(0))
    msgs = [Message(RecordDict({"arrays": vector_to_arrayrecord(flat), "config": conf}), dst_node_id=i,
                    message_type="train") for i in (1, 2)]
    replies = {r.metadata.src_node_id: r for r in grid.send_and_receive(msgs)}
    assert replies[1].content["metrics"]["steps"] == 7
    assert replies[2].content["metrics"]["steps"] == 1
    assert replies[2].content["node"]["device_class"] == "edge-lte"


def test_policy_change_applies_from_next_round(store):
    cfg = RunConfig(clients=3, rounds=3, devices="gpu:1,edge-lte:2", policies={"edge-lte": {"local_steps": 1}})
    rid = store.create_run(cfg.model_dump())

    def change(rnd, row):
        if rnd == 1:
            store.add_control(rid, "policy", {"device_class": "edge-lte", "policy": {"local_steps": 4}})

    assert run_inprocess(cfg, store=store, run_id=rid, listeners=[change]) == "finished"
    rows = store.node_rounds(rid)
    edge = {r.round: r.policy for r in rows if r.device_class == "edge-lte"}
    assert edge[1] == {"local_steps": 1}
    assert edge[2] == {"local_steps": 4} and edge[3] == {"local_steps": 4}
    assert {r.device_class for r in rows} == {"gpu", "edge-lte"}
    applied = [e for e in store.events(rid) if e.kind == "policy_applied"]
    assert applied and "applies from round 2" in applied[0].message
