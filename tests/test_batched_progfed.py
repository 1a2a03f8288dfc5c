"""The batched engine serves ProgFed: every round's global model equals the in-process
engine's to 1e-5 across stage boundaries, bytes up equal to the byte, the same stage,
FLOPs and stage sub-model evaluation in every round's row, for the plain schedule, a
capped device class (a kept head), momentum with a server step, and sampling."""

import pytest

from fedswarm.tasks import TASKS
from fedswarm.tasks.staged import STAGED_TASKS
from tests.test_batched import same_models_on_both_engines


@pytest.fixture(autouse=True)
def _staged_tasks(monkeypatch):
    for name, task in STAGED_TASKS.items():
        monkeypatch.setitem(TASKS, name, task)


BASE = dict(strategy="progfed", task="digits-cnn4", clients=8, rounds=5, local_steps=2, lr=0.1,
            params={"stage_rounds": 1})
CASES = {
    # stages 1, 2, 3 and the full model (4) from round 4 on: three boundaries
    "stages": dict(fraction=0.75),
    # a class capped at stage 2 keeps training G_2 ∘ E_2 ∘ E_1 while the others go on
    "capped-class": dict(rounds=4, devices="gpu:4,edge-wifi:4",
                         policies={"edge-wifi": {"progfed_max_stage": 2, "local_steps": 3, "batch_size": 8}}),
    "momentum-server-lr": dict(rounds=3, momentum=0.9, lr=0.05, params={"stage_rounds": 2, "server_lr": 0.5}),
}
SAME = ("stage", "eval_stage", "flops", "num_clients", "bytes_up", "rejected")


@pytest.mark.parametrize("case", sorted(CASES))
def test_batched_serves_progfed(case, tmp_path, monkeypatch):
    kw = {**BASE, **CASES[case]}
    _, got_res, pairs = same_models_on_both_engines(kw, tmp_path, monkeypatch)
    stages = [r_ref["stage"] for r_ref, _ in pairs]
    assert len(set(stages)) > 1, stages  # a stage boundary was crossed
    for r_ref, r_got in pairs:
        assert {k: r_got.get(k) for k in SAME} == {k: r_ref.get(k) for k in SAME}
        assert r_got["flops"] > 0
        for key in ("train_loss", "test_loss", "test_accuracy"):
            assert r_got[key] == pytest.approx(r_ref[key], abs=1e-5), key
        # the train message's config names the engine: 'batched' is 2 bytes shorter than 'inprocess'
        assert r_ref["bytes_down"] - r_got["bytes_down"] == 2 * r_ref["num_clients"]
