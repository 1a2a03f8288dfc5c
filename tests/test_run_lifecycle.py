"""One engine interface and one run lifecycle: the registry picks the engine that runs a config,
refuses a resume where the engine cannot do one, and every engine records a run's end the same
way (a privacy budget reached is ``stopped`` on the in-process and the batched engine alike)."""

import os
import socket
from typing import get_args

import pytest

from fedswarm.algorithms.privacy.accountant import PrivacyBudgetExceeded
from fedswarm.config import RunConfig
from fedswarm.errors import ConfigError
from fedswarm.procs import process_start
from fedswarm.server.recorder import StopRun, run_recorded
from fedswarm.sim.engines import ENGINES, check_config, engine_for, run_engine


def test_every_engine_the_config_names_is_registered():
    assert tuple(ENGINES) == get_args(RunConfig.model_fields["engine"].annotation)
    assert [e.name for e in ENGINES.values() if e.can_resume] == ["inprocess", "flower"]


@pytest.mark.parametrize("kw, engine", [
    ({}, "inprocess"),
    ({"engine": "batched"}, "batched"),
    ({"engine": "flower"}, "flower"),
    ({"strategy": "dpsgd", "engine": "array"}, "array"),
    ({"strategy": "lsgd"}, "array"),  # it needs every worker's loss: the array engine only
    ({"strategy": "lsgd", "engine": "clock", "params": {"mode": "async"}}, "clock"),
    ({"strategy": "adpsgd"}, "clock"),  # asynchronous: the virtual clock times it
    ({"strategy": "adpsgd", "params": {"schedule": "fixed"}}, "inprocess"),  # a seeded schedule on the one asked
    ({"strategy": "prague", "engine": "batched"}, "clock"),
])
def test_engine_for_picks_the_engine_that_runs_the_config(kw, engine):
    assert engine_for(RunConfig(**kw)).name == engine


def test_each_engine_checks_its_own_configs():
    with pytest.raises(ConfigError, match="--engine batched serves"):
        check_config(RunConfig(strategy="dpsgd", engine="batched"))
    with pytest.raises(ConfigError, match="the virtual clock runs adpsgd, prague and lsgd"):
        check_config(RunConfig(strategy="fedavg", engine="clock"))
    with pytest.raises(ConfigError, match="the array engine runs"):
        check_config(RunConfig(strategy="fedavg", engine="array"))
    assert check_config(RunConfig(strategy="fedavg", engine="batched")).name == "batched"


@pytest.mark.parametrize("kw", [{"engine": "batched"}, {"strategy": "dpsgd", "engine": "array"},
                                {"strategy": "adpsgd"}])
def test_resume_is_refused_by_the_registry_naming_the_engines_that_can(store, kw):
    cfg = RunConfig(clients=2, rounds=1, **kw)
    rid = store.create_run(cfg.model_dump())
    with pytest.raises(ConfigError, match=f"the {engine_for(cfg).name} engine cannot resume a run.*"
                                          "the engines that can: inprocess, flower"):
        run_engine(cfg, store=store, run_id=rid, resume=object())
    assert store.get_run(rid).status == "pending"  # refused before anything ran


def _events(store, rid):
    return {e.kind: e.message for e in store.events(rid)}


def test_lifecycle_records_each_way_a_run_ends(store):
    """run_recorded: finished; a stop control and the privacy budget are ``stopped``; a crash
    is ``failed`` with its traceback, re-raised; an interrupt ``stopped``, re-raised. Each
    records this process as the run's owner."""
    def ends(exc):
        def loop():
            if exc is not None:
                raise exc
        return loop

    rid = store.create_run({})
    assert run_recorded(store, rid, ends(None)) == "finished"
    run = store.get_run(rid)
    assert (run.status, run.pid, run.host, run.pid_start) == ("finished", os.getpid(), socket.gethostname(),
                                                              process_start(os.getpid()))
    rid = store.create_run({})
    assert run_recorded(store, rid, ends(StopRun("stopped by tester after round 3"))) == "stopped"
    assert store.get_run(rid).error is None and _events(store, rid)["stopped"] == "stopped by tester after round 3"
    rid = store.create_run({})
    assert run_recorded(store, rid, ends(PrivacyBudgetExceeded("one more round would spend"))) == "stopped"
    assert _events(store, rid)["privacy_budget"] == "one more round would spend"
    rid = store.create_run({})
    with pytest.raises(ZeroDivisionError):
        run_recorded(store, rid, lambda: 1 / 0)
    run = store.get_run(rid)
    assert run.status == "failed" and run.error == "ZeroDivisionError: division by zero"
    assert "Traceback" in _events(store, rid)["error"] and "1 / 0" in _events(store, rid)["error"]
    rid = store.create_run({})
    with pytest.raises(KeyboardInterrupt):
        run_recorded(store, rid, ends(KeyboardInterrupt()))
    run = store.get_run(rid)
    assert (run.status, run.error) == ("stopped", "interrupted from the keyboard")


@pytest.mark.parametrize("engine", ["inprocess", "batched"])
def test_privacy_budget_reached_is_stopped_on_every_engine(store, engine):
    """DP-FedAvg with target_epsilon alone: the noise is calibrated to spend the budget in the
    planned 2 rounds, so a round added by a control would pass it; the run stops before that
    round, recorded ``stopped`` with a privacy_budget event, its 2 rounds kept."""
    cfg = RunConfig(clients=4, rounds=2, seed=1, local_steps=2, engine=engine, dp="target_epsilon=4")
    rid = store.create_run(cfg.model_dump())
    store.add_control(rid, "add_rounds", {"rounds": 1})
    assert run_engine(cfg, store=store, run_id=rid) == "stopped"
    run = store.get_run(rid)
    assert run.status == "stopped" and run.error is None
    assert "one more round would spend" in _events(store, rid)["privacy_budget"]
    assert [r.round for r in store.rounds(rid)] == [0, 1, 2]
    assert 0 < store.rounds(rid)[-1].metrics["epsilon"] <= 4
