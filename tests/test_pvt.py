"""PVT: frozen variables get no gradient and no optimizer state, the server averages each
variable over the clients that trained it and keeps the others, and the upload holds only
the trained variables (measured on the serialized message)."""

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from fedswarm.config import RunConfig
from fedswarm.params import ParamLayout, get_flat
from fedswarm.policy import PolicyBook
from fedswarm.sim.inprocess import InProcessGrid, run_inprocess
from fedswarm.algorithms.selection import pvt as pvt_schedule
from fedswarm.strategies.edge import pvt
from fedswarm.tasks import get_task
import fedswarm.train as train_mod
from fedswarm.train import trainer_for
from fedswarm.wire import message_nbytes, recorddict_nbytes, vector_to_arrayrecord


def _message(cfg: RunConfig, node_id: int, rnd: int = 1, policies: dict | None = None) -> tuple[Message, torch.Tensor]:
    conf = ConfigRecord({k: v for k, v in cfg.to_flat().items() if k != "policies"})
    conf["server-round"] = rnd
    PolicyBook(policies or {}).write(conf)
    flat = get_flat(get_task(cfg.task).model(cfg.seed))
    content = RecordDict({"arrays": vector_to_arrayrecord(flat), "config": conf})
    return Message(content, dst_node_id=node_id, message_type="train.pvt"), flat


def _context(cfg: RunConfig, node_id: int, pid: int, n: int, **node) -> Context:
    return Context(run_id=1, node_id=node_id, node_config={"partition-id": pid, "num-partitions": n, **node},
                   state=RecordDict(), run_config=cfg.to_flat())


def test_frozen_variables_get_no_gradient_and_no_optimizer_state(monkeypatch):
    cfg = RunConfig(task="digits-cnn", clients=2, strategy="pvt", params={"fraction": 0.34}, local_steps=3,
                    momentum=0.9, lr=0.05)
    trainer = trainer_for(cfg, 0, 2)
    for p in trainer.model.parameters():
        p.grad = None  # the trainer is cached: earlier tests may have left gradients
    stepped: list[int] = []  # id of each tensor the trainer's SGD step moves, in order
    params = dict(trainer.model.named_parameters())
    real_step = train_mod.sgd_step

    def spy_step(p, grad, buf, lr, momentum, active=None):
        stepped.append(id(p))
        return real_step(p, grad, buf, lr, momentum, active)

    monkeypatch.setattr(train_mod, "sgd_step", spy_step)
    msg, flat = _message(cfg, node_id=7)
    content = pvt.client_update(msg, _context(cfg, 7, 0, 2))
    layout = trainer.layout
    ids = content["update"]["ids"].numpy().tolist()
    k = pvt_schedule.num_selected(len(layout), 0.34)
    assert ids == pvt_schedule.select_variables(len(layout), k, pvt_schedule.selection_seed(cfg.seed, 1, 7)).tolist()
    trained = {layout.specs[i].name for i in ids}
    assert 0 < len(trained) < len(params)
    # three steps, each of exactly the trained tensors (the frozen ones have no gradient, no momentum)
    assert len(stepped) == 3 * len(trained)
    assert set(stepped) == {id(params[n]) for n in trained}
    assert all(p.requires_grad for p in params.values())  # unfrozen again after the round
    assert all(p.grad is None for p in params.values())
    # The frozen tensors kept the global values; the reply carries the trained ones' deltas.
    mask = layout.mask(sorted(trained))
    after = get_flat(trainer.model)
    assert torch.equal(after[~mask], flat[~mask])
    values = torch.from_numpy(content["update"]["values"].numpy())
    assert torch.allclose(values, after[mask] - flat[mask])


def test_upload_holds_only_trained_variables():
    cfg = RunConfig(task="digits-cnn", clients=2, strategy="pvt", params={"fraction": 0.5}, local_steps=2)
    d = trainer_for(cfg, 1, 2).layout.d
    msg, _ = _message(cfg, node_id=3)
    content = pvt.client_update(msg, _context(cfg, 3, 1, 2))
    trained = int(content["metrics"]["trained_params"])
    k = int(content["metrics"]["variables"])
    assert trained < d
    up = recorddict_nbytes(RecordDict({"update": content["update"]}))
    # float32 deltas + int32 ids + framing (Flower stores each array as .npy bytes: ~180 B each)
    assert 4 * trained + 4 * k <= up <= 4 * trained + 4 * k + 400
    full = recorddict_nbytes(RecordDict({"arrays": vector_to_arrayrecord(torch.zeros(d))}))
    assert up < full
    # The same round without ids: the server derives them from the shared seed.
    cfg_seed = cfg.model_copy(update={"params": {"fraction": 0.5, "send_ids": False}})
    msg2, _ = _message(cfg_seed, node_id=3)
    content2 = pvt.client_update(msg2, _context(cfg_seed, 3, 1, 2))
    assert "ids" not in content2["update"]
    reply, reply2 = Message(content, reply_to=msg), Message(content2, reply_to=msg2)
    assert message_nbytes(reply) - message_nbytes(reply2) == up - recorddict_nbytes(
        RecordDict({"update": content2["update"]}))
    assert 4 * k <= message_nbytes(reply) - message_nbytes(reply2) <= 4 * k + 250  # what the ids cost


def _reply(to: Message, ids: list[int], values: np.ndarray, n: int) -> Message:
    content = RecordDict({
        "update": ArrayRecord({"values": Array(values.astype(np.float32)), "ids": Array(np.array(ids, np.int32))}),
        "metrics": MetricRecord({"num-examples": n, "train_loss": 1.0}),
    })
    return Message(content, reply_to=to)


def test_server_averages_each_variable_over_its_trainers_and_keeps_the_rest():
    layout = ParamLayout.from_shapes([("a", (2, 3)), ("b", (3,)), ("c", (4,)), ("d", (2,))])
    rng = np.random.default_rng(0)
    x = rng.normal(size=layout.d).astype(np.float32)
    strategy = pvt.PartialVariableTraining(layout, fraction=0.5, server_lr=1.0, min_available_nodes=2)
    grid = InProcessGrid(None, 2)  # only sampling: no message is executed
    msgs = list(strategy.configure_train(1, vector_to_arrayrecord(x), ConfigRecord(), grid))
    size = {s.name: s.numel for s in layout}
    dA = {"a": rng.normal(size=6), "c": rng.normal(size=4)}
    dB = {"c": rng.normal(size=4), "d": rng.normal(size=2)}
    ra = _reply(msgs[0], [0, 2], np.concatenate([dA["a"], dA["c"]]), n=1)
    rb = _reply(msgs[1], [2, 3], np.concatenate([dB["c"], dB["d"]]), n=3)
    bad = _reply(msgs[1], [1, 1], np.zeros(6), n=5)  # repeated ids: rejected, costs nothing
    arrays, metrics = strategy.aggregate_train(1, [ra, rb, bad])
    new = np.concatenate([arrays[k].numpy().ravel() for k in arrays.keys()])
    off = {s.name: s.offset for s in layout}

    def part(v, name):
        return v[off[name] : off[name] + size[name]]

    # Oracle: plain numpy, per variable.
    np.testing.assert_allclose(part(new, "a"), part(x, "a") + dA["a"], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(part(new, "b"), part(x, "b"))  # nobody trained b
    np.testing.assert_allclose(part(new, "c"), part(x, "c") + (1 * dA["c"] + 3 * dB["c"]) / 4, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(part(new, "d"), part(x, "d") + dB["d"], rtol=1e-6, atol=1e-6)
    assert metrics["coverage"] == pytest.approx((layout.d - 3) / layout.d)


def test_pvt_runs_end_to_end_with_class_policies(store):
    """Two classes: edge-lte trains a quarter of the variables, gpu all of them; a round
    on the in-process engine finishes and the edge nodes upload less."""
    cfg = RunConfig(task="digits-cnn", strategy="pvt", clients=3, rounds=2, local_steps=4, devices="gpu:1,edge-lte:2",
                    policies={"edge-lte": {"pvt_fraction": 0.25, "local_steps": 8}, "gpu": {"pvt_fraction": 1.0}})
    rid = store.create_run(cfg.model_dump())
    assert run_inprocess(cfg, store=store, run_id=rid) == "finished"
    res = store.export_result(rid)
    assert [r["round"] for r in res["rounds"]] == [0, 1, 2]
    assert all(0 < r["coverage"] <= 1 for r in res["rounds"][1:])
    assert res["rounds"][-1]["test_loss"] < res["rounds"][0]["test_loss"]
    rows = store.node_rounds(rid)
    up = {}
    for r in rows:
        up.setdefault(r.device_class, []).append(r.bytes_up)
        assert r.policy == cfg.policies[r.device_class]
    assert max(up["edge-lte"]) < min(up["gpu"])


def test_ids_from_the_shared_seed_give_the_same_model():
    """With ``send_ids = false`` the server re-derives each node's variables from the
    shared seed: the same round gives the same model as with explicit ids."""
    import random

    from fedswarm.client.app import app

    models = []
    for send_ids in (True, False):
        cfg = RunConfig(task="digits-cnn", strategy="pvt", clients=2, local_steps=2,
                        params={"fraction": 0.34, "send_ids": send_ids})
        layout = trainer_for(cfg, 0, 2).layout
        strategy = pvt.build(pvt.resolve_params("pvt", cfg.params), pvt.BuildContext(cfg, layout))
        grid = InProcessGrid(app, 2, run_config=cfg.to_flat())
        random.seed(0)
        msg, flat = _message(cfg, node_id=1)
        msgs = list(strategy.configure_train(1, msg.content["arrays"], msg.content["config"], grid))
        arrays, _ = strategy.aggregate_train(1, list(grid.send_and_receive(msgs)))
        models.append(torch.from_numpy(arrays["vector"].numpy().copy()))
    assert torch.equal(models[0], models[1])
    k = pvt_schedule.num_selected(len(layout), 0.34)
    trained = set()
    for node in (1, 2):
        trained |= set(pvt_schedule.select_variables(len(layout), k, pvt_schedule.selection_seed(cfg.seed, 1,
                                                                                                 node)).tolist())
    untouched = layout.mask([s.name for i, s in enumerate(layout.specs) if i not in trained])
    assert untouched.any() and torch.equal(models[0][untouched], flat[untouched])
    assert not torch.equal(models[0][~untouched], flat[~untouched])


def test_all_variables_is_fedavg():
    """With fraction 1 every client trains every variable: the round is FedAvg's."""
    import random

    from flwr.serverapp.strategy import FedAvg

    from fedswarm.client.app import app

    cfg = RunConfig(task="digits-cnn", strategy="pvt", clients=3, local_steps=3, params={"fraction": 1.0})
    layout = trainer_for(cfg, 0, 3).layout
    msg, flat = _message(cfg, node_id=1)
    models = []
    for strategy, fedavg_cfg in ((pvt.build(pvt.resolve_params("pvt", cfg.params), pvt.BuildContext(cfg, layout)),
                                  None), (FedAvg(min_available_nodes=3),
                                          cfg.model_copy(update={"strategy": "fedavg"}))):
        run_cfg = fedavg_cfg or cfg
        grid = InProcessGrid(app, 3, run_config=run_cfg.to_flat())
        conf = ConfigRecord(dict(msg.content["config"]))
        random.seed(0)
        msgs = list(strategy.configure_train(1, msg.content["arrays"], conf, grid))
        arrays, _ = strategy.aggregate_train(1, list(grid.send_and_receive(msgs)))
        models.append(torch.from_numpy(np.concatenate([arrays[k].numpy().ravel() for k in arrays.keys()])))
    assert torch.allclose(models[0], models[1], atol=1e-6)
    assert not torch.equal(models[0], flat)


def test_layout_coords_are_the_trained_tensors_slices():
    """PVT's trained coordinates: one slice per chosen tensor, in layout order; take() of them
    is what the masked [d] vector holds (the oracle: the names' boolean mask)."""
    layout = ParamLayout.from_shapes([("a", (2, 3)), ("b", (4,)), ("c", (1,)), ("d", (3, 2))])
    ids = torch.tensor([0, 2, 3])
    assert layout.coords(ids) == [slice(0, 6), slice(10, 11), slice(11, 17)]
    x = torch.arange(float(layout.d))
    mask = layout.mask(["a", "c", "d"])
    assert torch.equal(layout.take(x, ids), x[mask])
    rows = torch.stack([x, -x])
    assert torch.equal(layout.take(rows, [1]), rows[:, 6:10])
