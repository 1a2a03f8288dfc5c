"""fedswarm.bench.arms: every benchmark arm runs through run_engine (the engine fedswarm run picks),
is checked and exported in one place."""

from __future__ import annotations

import pytest

from fedswarm.bench.arms import bytes_up_curve, run_arm, scratch_store
from fedswarm.config import RunConfig

TINY = dict(task="synthetic-logreg", clients=4, rounds=2, local_steps=1, seed=1)


def test_an_arm_runs_on_its_engine_and_is_exported():
    with scratch_store() as store:
        fed = run_arm(RunConfig(**TINY), store, name="tiny fedavg")
        assert fed.status == "finished" and store.get_run(fed.run_id).name == "tiny fedavg"
        assert [r["round"] for r in fed.rounds] == [0, 1, 2]
        assert [r["round"] for r in fed.trained_rounds] == [1, 2]
        assert fed.summary["final_test_accuracy"] == fed.rounds[-1]["test_accuracy"]
        assert fed.result == store.export_result(fed.run_id)
        assert fed.wall_s > 0
        # AD-PSGD timed by the clock goes where run_engine sends it: the virtual clock, whose rows
        # carry simulated seconds (the in-process engine's have none)
        clock = run_arm(RunConfig(**{**TINY, "rounds": 1}, strategy="adpsgd", topology="ring"), store)
        assert clock.trained_rounds[0]["sim_time_s"] > 0
        assert fed.trained_rounds[0]["sim_time_s"] is None


def test_an_arm_that_does_not_finish_is_an_error_naming_it():
    cfg = RunConfig(**TINY)
    with scratch_store() as store:
        def stopped_after_round_1(run_id: str):  # a stop control, as edge's HL arms send
            def listener(rnd: int, row: dict) -> None:
                if rnd == 1:
                    store.add_control(run_id, "stop", {})
            return listener

        rid = store.create_run(cfg.model_dump(), name="tiny")
        with pytest.raises(RuntimeError, match=r"^arm 'tiny' ended stopped$"):
            run_arm(cfg, store, name="tiny", run_id=rid, listeners=[stopped_after_round_1(rid)])
        # an arm a listener stops on purpose, and a caller that reports the status itself
        for ok in (("finished", "stopped"), None):
            rid = store.create_run(cfg.model_dump())
            arm = run_arm(cfg, store, run_id=rid, listeners=[stopped_after_round_1(rid)], ok=ok)
            assert arm.status == "stopped" and [r["round"] for r in arm.trained_rounds] == [1]


def test_bytes_up_curve_accumulates():
    rows = [{"bytes_up": 0, "test_accuracy": 0.1}, {"bytes_up": 30, "test_accuracy": 0.5},
            {"bytes_up": None, "test_accuracy": 0.6}, {"bytes_up": 12, "test_accuracy": 0.7}]
    assert bytes_up_curve(rows) == [[0, 0.1], [30, 0.5], [30, 0.6], [42, 0.7]]
