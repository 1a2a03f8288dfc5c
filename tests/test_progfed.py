"""ProgFed: stage transitions keep the trained blocks and drop the head, the final stage is
the full model, capped device classes train a prefix, and compute is counted."""

import random

import pytest
import torch
from flwr.app import ConfigRecord

from fedswarm.config import RunConfig
from fedswarm.errors import ConfigError
from fedswarm.params import ParamLayout, get_flat
from fedswarm.policy import PolicyBook
from fedswarm.sim.inprocess import InProcessGrid, run_inprocess
from fedswarm.algorithms.selection import progfed as progfed_schedule
from fedswarm.strategies.edge import progfed
from fedswarm.strategies.registry import BuildContext, resolve_params
from fedswarm.tasks import TASKS
from fedswarm.tasks.base import cross_entropy
from fedswarm.tasks.staged import STAGED_TASKS, cnn4, resnet_staged, step_flops
from fedswarm.wire import arrayrecord_to_vector, vector_to_arrayrecord


@pytest.fixture(autouse=True)
def _staged_tasks(monkeypatch):
    for name, task in STAGED_TASKS.items():
        monkeypatch.setitem(TASKS, name, task)


def test_schedule_follows_the_paper():
    assert progfed_schedule.default_stage_rounds(3000, 4) == 375  # the CIFAR-100 config
    assert progfed_schedule.default_stage_rounds(400, 4) == 50
    stages = [progfed_schedule.stage_of(t, 50, 4) for t in range(1, 401)]
    assert stages.count(1) == stages.count(2) == stages.count(3) == 50 and stages.count(4) == 250


@pytest.mark.parametrize("make", [lambda: cnn4(1, 10), lambda: resnet_staged(3, 10, width=4)])
def test_final_stage_is_the_full_model(make):
    torch.manual_seed(0)
    model = make()
    S = model.num_stages
    full = model.stage_model(S)
    assert [id(p) for p in full.parameters()] == [id(p) for p in model.parameters()]
    assert ParamLayout.from_module(model).d == model.prefix_numel(S) + model.head_numel(S)
    x = torch.randn(2, *((1, 8, 8) if model.widths[0] == 8 else (3, 32, 32)))
    assert torch.equal(full(x), model(x))
    # Earlier stages: a prefix of the blocks (a prefix of the flat vector) and a small head.
    flat = get_flat(model)
    for s in range(1, S):
        sub = model.stage_model(s)
        assert torch.equal(get_flat(sub)[: model.prefix_numel(s)], flat[: model.prefix_numel(s)])
        assert sub(x).shape == (2, 10)


def _run_rounds(cfg: RunConfig, rounds: int, policies: dict | None = None):
    """Drive the strategy directly over the in-process engine; capture each round's
    message, replies and resulting full model."""
    from fedswarm.client.app import app

    task = TASKS[cfg.task]
    model = task.model(cfg.seed)
    strategy = progfed.build(resolve_params("progfed", cfg.params), BuildContext(cfg, ParamLayout.from_module(model)))
    grid = InProcessGrid(app, cfg.clients, run_config=cfg.to_flat())
    conf = ConfigRecord({k: v for k, v in cfg.to_flat().items() if k != "policies"})
    PolicyBook(policies or {}).write(conf)
    arrays = vector_to_arrayrecord(get_flat(model))
    log = []
    random.seed(0)
    for t in range(1, rounds + 1):
        msgs = list(strategy.configure_train(t, arrays, conf, grid))
        replies = list(grid.send_and_receive(msgs))
        heads_kept = set(strategy.heads)
        new, metrics = strategy.aggregate_train(t, replies)
        log.append(dict(stage=strategy.stage_of(t), msg=msgs[0], replies=replies, before=arrayrecord_to_vector(arrays),
                        after=arrayrecord_to_vector(new), heads=heads_kept, metrics=metrics))
        arrays = new
    return strategy, model, log


def test_stage_transitions_keep_blocks_and_drop_the_head():
    cfg = RunConfig(task="digits-cnn4", strategy="progfed", clients=2, rounds=4, local_steps=3, lr=0.1,
                    params={"stage_rounds": 1})
    strategy, model, log = _run_rounds(cfg, 4)
    d = ParamLayout.from_module(model).d
    P = [0] + [model.prefix_numel(s) for s in range(1, 5)]
    for t, r in enumerate(log, start=1):
        assert r["stage"] == t
        sent = arrayrecord_to_vector(r["msg"].content["arrays"])
        if t < 4:
            # blocks 1..t as trained so far (kept), then a freshly initialized head of stage t
            assert torch.equal(sent[: P[t]], r["before"][: P[t]])
            assert torch.equal(sent[P[t]:], strategy.new_head(t))
            assert r["heads"] == {t}  # the previous stage's head was dropped
        else:
            assert sent.numel() == d and torch.equal(sent, r["before"])  # the full model
            assert r["heads"] == set()
        moved = (r["after"] != r["before"])
        assert moved[P[t - 1] : P[t]].any()  # the new block trained
        assert not moved[P[t] : P[4]].any()  # blocks not yet active sit idle
        if t < 4:
            assert not moved[P[4]:].any()  # so does the classifier
    # Earlier blocks keep training after their stage (warm start, not frozen).
    assert (log[2]["after"][: P[1]] != log[0]["after"][: P[1]]).any()
    # Bytes: only the active sub-model travels, both ways.
    sizes = [r["msg"].content["arrays"]["vector"].numpy().size for r in log]
    assert sizes == [P[1] + model.head_numel(1), P[2] + model.head_numel(2), P[3] + model.head_numel(3), d]
    up = [r["replies"][0].content["update"]["delta"].numpy().size for r in log]
    assert up == sizes


def test_capped_class_trains_a_prefix_and_the_merge_averages_per_parameter():
    cfg = RunConfig(task="digits-cnn4", strategy="progfed", clients=2, rounds=2, local_steps=3, lr=0.1,
                    devices="gpu:1,edge-lte:1", params={"stage_rounds": 1})
    policies = {"edge-lte": {"progfed_max_stage": 1}}
    strategy, model, log = _run_rounds(cfg, 2, policies)
    P1, P2 = model.prefix_numel(1), model.prefix_numel(2)
    r = log[1]  # stage 2: the edge node trains stage 1 with the kept head G_1
    assert r["stage"] == 2 and r["heads"] == {1, 2}
    assert set(r["msg"].content["heads"].keys()) == {"head.1"}
    by_stage = {int(rep.content["metrics"]["stage"]): rep for rep in r["replies"]}
    assert set(by_stage) == {1, 2}
    delta = {s: torch.from_numpy(rep.content["update"]["delta"].numpy()) for s, rep in by_stage.items()}
    n = {s: float(rep.content["metrics"]["num-examples"]) for s, rep in by_stage.items()}
    assert delta[1].numel() == P1 + model.head_numel(1)
    # Oracle: block 1 averages both clients, block 2 only the uncapped one.
    want1 = r["before"][:P1] + (n[1] * delta[1][:P1] + n[2] * delta[2][:P1]) / (n[1] + n[2])
    assert torch.allclose(r["after"][:P1], want1, atol=1e-6)
    assert torch.allclose(r["after"][P1:P2], r["before"][P1:P2] + delta[2][P1:P2], atol=1e-6)
    assert 1 in strategy.heads and 2 in strategy.heads  # G_1 kept for the capped class


def test_flops_are_counted_per_sample_and_grow_with_the_stage():
    model = cnn4(1, 10)
    x, y = torch.randn(4, 1, 8, 8), torch.randint(0, 10, (4,))
    per_stage = [step_flops(model.stage_model(s), cross_entropy, x, y) for s in range(1, 5)]
    assert per_stage == sorted(per_stage) and per_stage[0] < per_stage[-1] / 10
    assert per_stage[-1] == step_flops(model, cross_entropy, x, y)
    assert step_flops(model, cross_entropy, x[:1], y[:1]) * 4 == per_stage[-1]  # linear in the batch
    assert progfed_schedule.samples_processed(10, 4, 4) == 4 + 4 + 2 + 4


def test_progfed_runs_end_to_end(store):
    cfg = RunConfig(task="digits-cnn4", strategy="progfed", clients=3, rounds=4, local_steps=3, lr=0.1)
    rid = store.create_run(cfg.model_dump())
    assert run_inprocess(cfg, store=store, run_id=rid) == "finished"
    rows = store.export_result(rid)["rounds"][1:]
    assert [r["stage"] for r in rows] == [1, 2, 3, 4]
    assert [r.get("eval_stage") for r in rows] == [1, 2, 3, None]
    assert all(r["flops"] > 0 for r in rows) and rows[0]["flops"] < rows[3]["flops"]
    down = [r["bytes_down"] for r in rows]
    assert down == sorted(down) and down[0] < down[3] / 10


def test_progfed_needs_a_staged_task():
    cfg = RunConfig(task="digits-mlp", strategy="progfed", clients=2)
    with pytest.raises(ConfigError, match="staged"):
        progfed.build(resolve_params("progfed", {}), BuildContext(cfg, None))


def test_more_rounds_continue_the_schedule():
    """A run extended with more rounds (start() called again) does not restart at stage 1."""
    from fedswarm.client.app import app

    cfg = RunConfig(task="digits-cnn4", strategy="progfed", clients=2, rounds=2, local_steps=1,
                    params={"stage_rounds": 1})
    model = TASKS[cfg.task].model(cfg.seed)
    strategy = progfed.build(resolve_params("progfed", cfg.params), BuildContext(cfg, ParamLayout.from_module(model)))
    grid = InProcessGrid(app, 2, run_config=cfg.to_flat())
    conf = ConfigRecord({k: v for k, v in cfg.to_flat().items() if k != "policies"})
    seen = []
    real = strategy.configure_train

    def spy(rnd, arrays, config, grid):
        msgs = list(real(rnd, arrays, config, grid))
        seen.append(int(config["progfed.stage"]))
        return msgs

    strategy.configure_train = spy
    res = strategy.start(grid, vector_to_arrayrecord(get_flat(model)), num_rounds=2, train_config=conf)
    strategy.start(grid, res.arrays, num_rounds=3, train_config=conf)
    assert seen == [1, 2, 3, 4, 4]
