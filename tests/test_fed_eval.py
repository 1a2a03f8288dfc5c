"""Federated evaluation: the round's cohort scores the model on its own validation split.

Oracles: the validation splits partition the held-out test set, so with every node in the cohort
the example-weighted federated accuracy IS the central test accuracy; the batched engine (its
own round loop) gives the in-process engine's numbers per round and per node, and the array
engine the router's; a decentralized node's value is its own model (read from its state after
the run, or from the virtual clock's nodes) scored on its split; the evaluate messages' bytes
are kept out of the round's training bytes.
"""

from __future__ import annotations

import itertools
import logging

import numpy as np
import pytest
import torch

from fedswarm.config import RunConfig
from fedswarm.errors import ConfigError
from fedswarm.store import Store
from fedswarm.tasks import get_task
from fedswarm.train import node_validation, task_data
from tests.helpers import record_run
from tests.minibatch_oracle import batches

TASK = "digits-mlp"


def _run(cfg: RunConfig, tmp_path, monkeypatch, name: str) -> tuple[dict, list]:
    import fedswarm.sim.inprocess as inprocess

    monkeypatch.setattr(inprocess, "_run_ids", itertools.repeat(1))  # the same run id on both engines
    _, result, nodes = record_run(cfg, tmp_path / f"{name}.db")
    return result, nodes


def test_validation_splits_partition_the_test_set_and_leave_training_data_alone():
    cfg = RunConfig(task=TASK, clients=7, seed=3)
    data = task_data(cfg)
    xs = [node_validation(cfg, p, 7)[0] for p in range(7)]
    assert sum(x.shape[0] for x in xs) == data.test_x.shape[0]
    rows = {tuple(r.tolist()) for x in xs for r in x}
    assert rows == {tuple(r.tolist()) for r in data.test_x}  # every test example, once
    again = node_validation(RunConfig(task=TASK, clients=7, seed=3), 2, 7)[0]
    assert torch.equal(again, xs[2])  # seeded: the same split every time
    assert not torch.equal(node_validation(RunConfig(task=TASK, clients=7, seed=4), 2, 7)[0], xs[2])
    with pytest.raises(ValueError, match="partition-id 7"):
        node_validation(cfg, 7, 7)


def test_full_cohort_federated_accuracy_is_the_central_accuracy_and_eval_bytes_are_apart(tmp_path, monkeypatch):
    cfg = RunConfig(task=TASK, clients=4, rounds=2, seed=1, local_steps=2, eval_every=2)
    res, nodes = _run(cfg, tmp_path, monkeypatch, "full")
    r1, r2 = res["rounds"][1], res["rounds"][2]
    assert r1["fed_accuracy"] is None and "eval_bytes_up" not in r1  # eval_every=2: round 1 has none
    assert r2["fed_accuracy"] == pytest.approx(r2["test_accuracy"], abs=1e-6)
    assert r2["fed_loss"] == pytest.approx(r2["test_loss"], abs=1e-5)
    assert r2["fed_examples"] == task_data(cfg).test_x.shape[0]
    # the evaluate messages are counted, and not as training traffic: both rounds trained alike
    assert r2["eval_bytes_down"] > 0 and r2["eval_bytes_up"] > 0
    assert r1["bytes_up"] == r2["bytes_up"] and r1["bytes_down"] == r2["bytes_down"]
    per_node = [n for n in nodes if n.round == 2]
    assert len(per_node) == 4 and sum(n.fed_examples for n in per_node) == r2["fed_examples"]
    weighted = sum(n.fed_accuracy * n.fed_examples for n in per_node) / r2["fed_examples"]
    assert weighted == pytest.approx(r2["fed_accuracy"], abs=1e-9)
    assert res["summary"]["final_fed_accuracy"] == r2["fed_accuracy"]


def test_batched_engine_gives_the_inprocess_federated_numbers(tmp_path, monkeypatch):
    kw = dict(task=TASK, clients=6, rounds=3, fraction=0.5, seed=2, local_steps=3, partition="dirichlet:0.5")
    ref, ref_nodes = _run(RunConfig(engine="inprocess", **kw), tmp_path, monkeypatch, "inproc")
    got, got_nodes = _run(RunConfig(engine="batched", **kw), tmp_path, monkeypatch, "batched")
    for a, b in zip(ref["rounds"][1:], got["rounds"][1:], strict=True):
        assert a["fed_examples"] == b["fed_examples"] < task_data(RunConfig(**kw)).test_x.shape[0]  # 3 of 6 nodes
        assert abs(a["fed_accuracy"] - b["fed_accuracy"]) <= 1e-6 and abs(a["fed_loss"] - b["fed_loss"]) <= 1e-5
    per = {(n.round, n.node_id): n for n in ref_nodes}
    assert len(per) == 9 == len(got_nodes)
    for n in got_nodes:  # the same cohort, node by node
        m = per[(n.round, n.node_id)]
        assert n.fed_examples == m.fed_examples and abs(n.fed_accuracy - m.fed_accuracy) <= 1e-6


def test_central_eval_off_loads_no_server_test_set(tmp_path, monkeypatch):
    import fedswarm.server.app as server_app

    def no_data(*_a, **_k):
        raise AssertionError("the server loaded the task's data with central_eval off")

    monkeypatch.setattr(server_app, "task_data", no_data)
    cfg = RunConfig(task=TASK, clients=3, rounds=2, seed=1, local_steps=4, central_eval=False)
    res, _ = _run(cfg, tmp_path, monkeypatch, "nocentral")
    assert all(r["test_accuracy"] is None for r in res["rounds"])
    assert all(r["fed_accuracy"] > 0.2 for r in res["rounds"][1:]), [r["fed_accuracy"] for r in res["rounds"]]
    s = res["summary"]
    assert s["final_test_accuracy"] is None and s["final_fed_accuracy"] == res["rounds"][-1]["fed_accuracy"]
    assert s["best_fed_accuracy"] == max(r["fed_accuracy"] for r in res["rounds"][1:])


def test_decentralized_nodes_score_their_own_models(tmp_path):
    from flwr.supercore.task_identity import TaskIdentity

    from fedswarm.client.app import app as client_app
    from fedswarm.params import ParamLayout
    from fedswarm.server.app import run_server
    from fedswarm.sim.inprocess import InProcessGrid
    from fedswarm.strategies.decentralized.node import own_model
    from fedswarm.train import evaluate_flat

    cfg = RunConfig(task=TASK, strategy="dpsgd", clients=4, rounds=2, seed=1, local_steps=2, topology="ring")
    grid = InProcessGrid(client_app, cfg.clients, run_config=cfg.to_flat())
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = grid.run.run_id, 1, 0
    store = Store(tmp_path / "d.db")
    rid = store.create_run(cfg.model_dump())
    assert run_server(grid, cfg, store=store, run_id=rid) == "finished"
    last = {n.node_id: n for n in store.node_rounds(rid) if n.round == 2}
    task = get_task(TASK)
    model = task.model(cfg.seed)
    d = ParamLayout.from_module(model).d
    accs = []
    for nid, ctx in grid.contexts.items():
        x, y = node_validation(cfg, nid - 1, cfg.clients)
        loss, acc = evaluate_flat(task, model, own_model(ctx, d), x, y, torch.device("cpu"))
        assert last[str(nid)].fed_accuracy == pytest.approx(acc, abs=1e-6)
        assert last[str(nid)].fed_loss == pytest.approx(loss, abs=1e-5)
        accs.append(acc)
    row = store.rounds(rid)[-1]
    w = np.array([last[str(n)].fed_examples for n in grid.contexts])
    assert row.fed_accuracy == pytest.approx(float(np.dot(accs, w) / w.sum()), abs=1e-9)
    store.close()


def test_eval_every_and_central_eval_are_checked():
    with pytest.raises(ConfigError, match="eval_every"):
        RunConfig.build({"eval_every": 0})
    with pytest.raises(ConfigError, match="round_timeout"):
        RunConfig.build({"round_timeout": -1})
    # unset, they stay out of what every message carries (runs that do not use them send what they sent)
    assert not {"eval_every", "central_eval", "round_timeout"} & set(RunConfig().to_flat())
    flat = RunConfig(eval_every=3, central_eval=False, round_timeout=5.0).to_flat()
    assert (flat["eval_every"], flat["central_eval"], flat["round_timeout"]) == (3, False, 5.0)
    assert RunConfig.from_flat(flat).eval_every == 3


def test_a_node_that_never_answers_is_named_failed_and_trains_again_when_back(tmp_path, caplog):
    """In process, fast: node 2's replies of round 2 are lost (a link cut off; the real SuperLink
    and a frozen SuperNode: tests/test_deployment_flaky_link.py). Round 2 completes with the others
    and names node 2 failed (a warning in fedswarm's words, the console's); in round 3 it trains
    again; its federated evaluation is lost with it."""
    from flwr.supercore.task_identity import TaskIdentity

    from fedswarm.client.app import app as client_app
    from fedswarm.server.app import run_server
    from fedswarm.sim.inprocess import InProcessGrid

    class CutLink(InProcessGrid):
        def pull_messages(self, message_ids):
            ids = list(message_ids)
            lost = {mid for mid in ids if mid in self._queue and self._queue[mid].metadata.dst_node_id == 2
                    and self._queue[mid].content.config_records["config"]["server-round"] == 2}  # train and evaluate
            return [r for r in super().pull_messages(ids) if r.metadata.reply_to_message_id not in lost]

    cfg = RunConfig(task=TASK, clients=3, rounds=3, seed=1, local_steps=2)
    grid = CutLink(client_app, cfg.clients, run_config=cfg.to_flat())
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = grid.run.run_id, 1, 0
    store = Store(tmp_path / "cut.db")
    rid = store.create_run(cfg.model_dump())
    with caplog.at_level(logging.WARNING, logger="fedswarm.server"):
        assert run_server(grid, cfg, store=store, run_id=rid) == "finished"
    assert [r.getMessage() for r in caplog.records if "nodes failed" in r.getMessage()] == [
        f"run {rid}: round 2: 1 of 3 nodes failed (no reply before the round's timeout); aggregated the 2 others "
        f"(strategy minimum 1)"]
    rows = {(n.round, n.node_id): n for n in store.node_rounds(rid)}
    cut = rows[(2, "2")]
    assert cut.status == "failed" and "no reply" in cut.reason and cut.fed_accuracy is None
    assert all(rows[(2, n)].status == "ok" for n in ("1", "3"))
    assert rows[(3, "2")].status == "ok" and rows[(3, "2")].fed_accuracy is not None
    r2 = {r.round: r for r in store.rounds(rid)}[2]
    assert r2.metrics["nodes_failed"] == 1 and r2.metrics["fed_failed"] == 1
    assert r2.fed_examples == sum(rows[(2, n)].fed_examples for n in ("1", "3"))
    store.close()


def test_client_data_with_central_eval_off_same_federated_accuracy_on_inprocess_and_batched(tmp_path, monkeypatch):
    """`fedswarm sim --client-data DIR --central-eval off` on both engines: each client scores the
    model on the validation split of its own dataset, and the engines agree per round and node."""
    from tests.test_localdata import _client_dir

    root, sizes = _client_dir(tmp_path)
    kw = dict(task=TASK, client_data=str(root), clients=3, rounds=3, seed=4, local_steps=3, central_eval=False)
    ref, ref_nodes = _run(RunConfig(engine="inprocess", **kw), tmp_path, monkeypatch, "inproc")
    got, got_nodes = _run(RunConfig(engine="batched", **kw), tmp_path, monkeypatch, "batched")
    val = sum(round(0.2 * n) for n in sizes)  # --val-fraction 0.2 of each client's own examples
    _same_federated_numbers(ref, ref_nodes, got, got_nodes, val)
    assert got["summary"]["final_fed_accuracy"] == pytest.approx(ref["summary"]["final_fed_accuracy"], abs=1e-6)



def _same_federated_numbers(ref, ref_nodes, got, got_nodes, val: int) -> None:
    """Two engines' federated numbers of a 3-client, 3-round run with no server test set: every
    round row (examples exact, accuracy to 1e-6, loss to 1e-5) and every node-round row."""
    for a, b in zip(ref["rounds"][1:], got["rounds"][1:], strict=True):
        assert a["test_accuracy"] is None and b["test_accuracy"] is None
        assert a["fed_examples"] == b["fed_examples"] == val
        assert abs(a["fed_accuracy"] - b["fed_accuracy"]) <= 1e-6 and abs(a["fed_loss"] - b["fed_loss"]) <= 1e-5
    per = {(n.round, n.node_id): n for n in ref_nodes}
    assert len(per) == 9 == len(got_nodes)
    for n in got_nodes:
        m = per[(n.round, n.node_id)]
        assert n.fed_examples == m.fed_examples and abs(n.fed_accuracy - m.fed_accuracy) <= 1e-6
        assert abs(n.fed_loss - m.fed_loss) <= 1e-5


@pytest.mark.parametrize("strategy", ["dpsgd", "d2"])
def test_array_engine_gives_the_routers_federated_numbers_with_client_data(tmp_path, monkeypatch, strategy):
    """`--client-data DIR --central-eval off` on a decentralized strategy: the array engine (rows of
    [n, d]) and the router (fedswarm's ServerApp and ClientApps, a deployment's code, in process)
    give the same federated numbers, round by round and node by node: each node scores its own
    model after the round's mix (D²'s local step moves x before the next mix; that is not its
    model) on the validation split of its own dataset. No server test set is loaded."""
    import fedswarm.sim.array_engine as array_engine
    from tests.test_localdata import _client_dir

    def no_data(*_a, **_k):
        raise AssertionError("the array engine loaded the task's test set with central_eval off")

    monkeypatch.setattr(array_engine, "task_data", no_data)
    root, sizes = _client_dir(tmp_path)
    kw = dict(task=TASK, strategy=strategy, topology="ring", client_data=str(root), clients=3, rounds=3, seed=4,
              local_steps=2, central_eval=False)
    ref, ref_nodes = _run(RunConfig(engine="inprocess", **kw), tmp_path, monkeypatch, "router")
    got, got_nodes = _run(RunConfig(engine="array", **kw), tmp_path, monkeypatch, "array")
    val = sum(round(0.2 * n) for n in sizes)
    _same_federated_numbers(ref, ref_nodes, got, got_nodes, val)
    assert len({round(n.fed_loss, 6) for n in got_nodes}) == 9  # each node, each round: its own model
    assert got["summary"]["final_fed_accuracy"] == pytest.approx(ref["summary"]["final_fed_accuracy"], abs=1e-6)


def test_clock_engine_trains_on_client_data_and_scores_own_models_every_eval_every_rounds(tmp_path, monkeypatch):
    """AD-PSGD on the virtual clock with `--client-data DIR --central-eval off --eval-every 2`. A
    recorded round is n local steps between the nodes (here one each: equal devices), and
    federated evaluation counts those rounds: rounds 2 and 4 only. Oracles: node i's round-1 loss
    is the loss of the initial model on the first minibatch of ITS OWN train split (drawn here
    by hand); its round-4 values are its own final model scored on its own validation split."""
    import fedswarm.sim.async_clock as clock_loop
    import fedswarm.sim.async_engine as clock
    from fedswarm.config import round_seed
    from fedswarm.params import get_flat, set_flat
    from fedswarm.tasks.localdata import LocalDataSpec, load_local
    from fedswarm.train import evaluate_flat
    from tests.localdata_helpers import digits, write_npz
    from tests.test_localdata import _client_dir

    def no_data(*_a, **_k):
        raise AssertionError("the clock engine loaded the task's test set with central_eval off")

    sims = []

    class Kept(clock.ADPSGDSimulation):  # the nodes, to read their final models
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            sims.append(self)

    monkeypatch.setattr(clock_loop, "task_data", no_data)
    monkeypatch.setattr(clock, "ADPSGDSimulation", Kept)
    root, sizes = _client_dir(tmp_path)
    write_npz(root / "d.npz", *digits(slice(600, 700)))  # a fourth client: an even ring is bipartite
    sizes.append(100)
    cfg = RunConfig(task=TASK, strategy="adpsgd", topology="ring", client_data=str(root), clients=4, rounds=4,
                    seed=4, central_eval=False, eval_every=2)
    res, nodes = _run(cfg, tmp_path, monkeypatch, "clock")
    rows = {(n.round, n.node_id): n for n in nodes}
    assert [r["fed_examples"] is not None for r in res["rounds"][1:]] == [False, True, False, True]
    assert all(rows[(r, str(i))].fed_accuracy is None for r in (1, 3) for i in range(1, 5))
    assert res["rounds"][4]["fed_examples"] == sum(round(0.2 * n) for n in sizes)
    task = get_task(TASK)
    model = task.model(cfg.seed)
    x0 = get_flat(model).detach().clone()
    final = sims[0].x
    accs, counts = [], []
    for i, path in enumerate(sorted(root.iterdir())):
        own = load_local(TASK, LocalDataSpec(str(path), "label", 0.2), cfg.seed)
        assert rows[(1, str(i + 1))].num_examples == cfg.batch_size  # one step each in round 1
        batch = batches(own.train_y.shape[0], 1, cfg.batch_size, round_seed(cfg.seed, 1, i))[0]
        with torch.no_grad():
            set_flat(model, x0)
            first = float(task.objective(model, own.train_x[batch], own.train_y[batch]))
        assert rows[(1, str(i + 1))].train_loss == pytest.approx(first, abs=1e-5)
        loss, acc = evaluate_flat(task, model, final[i], own.val_x, own.val_y, torch.device("cpu"))
        last = rows[(4, str(i + 1))]
        assert last.fed_accuracy == pytest.approx(acc, abs=1e-6) and last.fed_loss == pytest.approx(loss, abs=1e-5)
        accs.append(acc)
        counts.append(own.val_y.shape[0])
    assert res["rounds"][4]["fed_accuracy"] == pytest.approx(float(np.dot(accs, counts) / sum(counts)), abs=1e-9)
    assert res["summary"]["final_fed_accuracy"] == res["rounds"][4]["fed_accuracy"]
