"""End to end on the in-process engine: attacks recorded per round, Solon's model unmoved by
liars, DP runs that store epsilon every round, and the start-up refusals."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from fedswarm.algorithms.privacy.accountant import PrivacyAccountant
from fedswarm.config import RunConfig
from fedswarm.errors import ConfigError
from fedswarm.params import ParamLayout
from fedswarm.server.app import build_strategy
from fedswarm.sim.inprocess import run_inprocess
from fedswarm.sim.report import summary_table
from fedswarm.tasks import get_task

SMALL = dict(clients=7, rounds=2, local_steps=3, batch_size=16, seed=4)


def _run(store, **kw):
    cfg = RunConfig(**{**SMALL, **kw})
    rid = store.create_run(cfg.model_dump())
    assert run_inprocess(cfg, store=store, run_id=rid) == "finished", store.get_run(rid).error
    return store.export_result(rid)


def test_solon_model_is_unmoved_by_liars(store):
    params = {"s": 1, "m": 2}
    clean = _run(store, strategy="solon", params=params)
    attacked = _run(store, strategy="solon", params=params, byzantine=1, attack="signflip:scale=10")
    for a, b in zip(clean["rounds"], attacked["rounds"]):
        assert b["test_loss"] == pytest.approx(a["test_loss"], rel=1e-5, abs=1e-6)
        assert b["test_accuracy"] == pytest.approx(a["test_accuracy"], abs=1e-9)
    rows = attacked["rounds"][1:]
    assert all(r["byzantine_nodes"] == rows[0]["byzantine_nodes"] and len(r["byzantine_nodes"]) == 1 for r in rows)
    # the decoder found exactly the attacker, from the messages alone
    assert all([str(n) for n in r["liars_located"]] == r["byzantine_nodes"] for r in rows)
    assert attacked["summary"]["attack"] == "signflip:scale=10.0"
    # Solon's uplink is about half of Draco-size messages (m = 2): d/2 floats a reply
    assert rows[0]["bytes_up"] < 7 * (4 * 4810 / 2 + 1500)


def test_solon_says_when_more_liars_than_it_corrects(store):
    res = _run(store, strategy="solon", params={"s": 1, "m": 2}, byzantine=2, attack="gaussian:std=1")
    rows = res["rounds"][1:]
    assert all("more than" in r["decode_failed"] for r in rows)
    assert res["rounds"][-1]["test_loss"] == pytest.approx(res["rounds"][0]["test_loss"])  # the model never moved


def test_fedavg_is_wrecked_and_the_attack_recorded(store):
    clean = _run(store, strategy="fedavg")
    bad = _run(store, strategy="fedavg", byzantine=2, attack="signflip:scale=10")
    assert bad["summary"]["final_test_accuracy"] < clean["summary"]["final_test_accuracy"] - 0.2
    assert len(bad["summary"]["byzantine_nodes"]) == 2


def test_dp_fedavg_stores_epsilon_every_round(store):
    res = _run(store, strategy="fedavg", rounds=3, dp="noise_multiplier=1.5,clip=1.0,delta=1e-5")
    eps = [r["epsilon"] for r in res["rounds"][1:]]
    for n, e in enumerate(eps, start=1):
        acc = PrivacyAccountant(1e-5)
        acc.step(1.0, 1.5, n)
        assert e == pytest.approx(acc.epsilon(), rel=1e-9)
    assert res["summary"]["epsilon"] == eps[-1] and res["summary"]["delta"] == 1e-5
    from rich.console import Console

    console = Console(record=True, width=200)
    console.print(summary_table(res))
    assert "privacy spent" in console.export_text()


def test_dp_composes_with_compression_and_target_epsilon(store):
    res = _run(store, strategy="compressed_fedavg", params={"codec": "topk"}, dp="target_epsilon=8,adaptive=true")
    assert 0 < res["summary"]["epsilon"] <= 8.0
    assert all(r["dp_clip"] > 0 for r in res["rounds"][1:])


def test_dp_sgd_reports_example_level_epsilon(store):
    res = _run(store, strategy="fedavg", clients=3, local_steps=2, dp_sgd="noise_multiplier=1.0,clip=1.0")
    eps = [r["epsilon_example"] for r in res["rounds"][1:]]
    assert 0 < eps[0] < eps[1] and res["summary"]["epsilon_example"] == eps[-1]


def _layout():
    return ParamLayout.from_module(get_task("digits-mlp").model(0))


@pytest.mark.parametrize("kw,match", [
    (dict(strategy="bulyan", clients=15, byzantine=4), "n >= 4f \\+ 3"),
    (dict(strategy="krum", clients=15, byzantine=7), "n > 2f \\+ 2"),
    (dict(strategy="solon", clients=15, byzantine=7), "P >= 2s \\+ m"),
    (dict(strategy="median", dp="noise_multiplier=1"), "does not support --dp"),
    (dict(strategy="dpsgd", byzantine=1), "federated strategies"),
])
def test_refused_at_start_with_the_bound(kw, match):
    with pytest.raises(ConfigError, match=match):
        build_strategy(RunConfig(**kw), _layout())


def test_cli_refuses_in_one_line(tmp_path):
    from fedswarm.cli import app

    out = CliRunner().invoke(app, ["sim", "--strategy", "bulyan", "--byzantine", "4", "--clients", "15",
                                   "--db", str(tmp_path / "x.db")])
    assert out.exit_code == 2
    out2 = CliRunner().invoke(app, ["sim", "--dp", "noise_multiplier=0.5,target_epsilon=1", "--rounds", "50",
                                    "--db", str(tmp_path / "x.db")])
    assert out2.exit_code == 2


def test_random_bytes_do_not_poison_fedavg(store):
    """Random payload bytes decode to non-finite floats: dropped, not averaged into NaN."""
    clean = _run(store, strategy="fedavg")
    res = _run(store, strategy="fedavg", byzantine=2, attack="random")
    # the five honest clients' average: about the clean run's accuracy, not NaN's 10%
    assert res["summary"]["final_test_accuracy"] > clean["summary"]["final_test_accuracy"] - 0.1


@pytest.mark.integration
@pytest.mark.slow
def test_attacks_apply_on_flowers_simulation_engine(tmp_path):
    """The same attack on Flower's Simulation Engine (Ray): recorded, and it wrecks FedAvg."""
    from fedswarm.sim.flower_engine import run_flower
    from fedswarm.store import Store

    store = Store(tmp_path / "ray.db")
    cfg = RunConfig(clients=4, rounds=2, local_steps=3, seed=2, engine="flower", byzantine=1,
                    attack="signflip:scale=20")
    rid = store.create_run(cfg.model_dump())
    assert run_flower(cfg, store=store, run_id=rid) == "finished"
    res = store.export_result(rid)
    assert all(len(r["byzantine_nodes"]) == 1 for r in res["rounds"][1:])
    assert res["summary"]["final_test_accuracy"] < 0.5
