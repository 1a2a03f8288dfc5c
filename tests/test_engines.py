"""The engines: same seed and config give the same model; rounds are recorded; controls
act between rounds; a failing client costs its update, not the run."""

import json
import subprocess
import sys

import pytest

from fedswarm.config import RunConfig
from fedswarm.sim.inprocess import run_inprocess
from fedswarm.store import Store


def _final_model(cfg, store):
    captured = {}

    def grab(rnd, row):
        captured[rnd] = row

    rid = store.create_run(cfg.model_dump())
    if cfg.engine == "flower":
        from fedswarm.sim.flower_engine import run_flower

        status = run_flower(cfg, store=store, run_id=rid, listeners=[grab])
    else:
        status = run_inprocess(cfg, store=store, run_id=rid, listeners=[grab])
    return rid, status, captured


def test_fedavg_inprocess_reaches_accuracy(store):
    cfg = RunConfig(clients=10, rounds=5, seed=3)
    rid, status, rows = _final_model(cfg, store)
    assert status == "finished"
    res = store.export_result(rid)
    assert [r["round"] for r in res["rounds"]] == list(range(6))
    assert res["summary"]["final_test_accuracy"] > 0.85
    # every round moved the model to all 10 clients and back: 4 bytes per parameter at least
    for r in res["rounds"][1:]:
        assert r["num_clients"] == 10
        assert 10 * 4 * 4810 < r["bytes_down"] < 10 * (4 * 4810 + 2000)
        assert 10 * 4 * 4810 < r["bytes_up"] < 10 * (4 * 4810 + 2000)
    assert len(store.node_rounds(rid)) == 50


@pytest.mark.integration
@pytest.mark.slow
def test_engines_give_the_same_model(tmp_path):
    """In-process and Flower's Simulation Engine (Ray): same accuracy and loss every round."""
    base = dict(clients=4, rounds=3, seed=5, partition="dirichlet:0.5")
    s1, s2 = Store(tmp_path / "a.db"), Store(tmp_path / "b.db")
    _, st1, rows1 = _final_model(RunConfig(**base, engine="inprocess"), s1)
    _, st2, rows2 = _final_model(RunConfig(**base, engine="flower"), s2)
    assert st1 == st2 == "finished"
    for rnd in range(4):
        assert rows1[rnd]["test_loss"] == pytest.approx(rows2[rnd]["test_loss"], rel=1e-5, abs=1e-6)
        assert rows1[rnd]["test_accuracy"] == pytest.approx(rows2[rnd]["test_accuracy"], abs=1e-9)
        if rnd:
            assert rows1[rnd]["train_loss"] == pytest.approx(rows2[rnd]["train_loss"], rel=1e-5)


def test_failing_client_costs_only_its_update(store, monkeypatch):
    import fedswarm.local as local

    real = local.trainer_for

    def flaky(cfg, pid, n, **kw):
        if pid == 1:
            raise RuntimeError("node 1 lost its disk")
        return real(cfg, pid, n, **kw)

    monkeypatch.setattr(local, "trainer_for", flaky)
    rid, status, _ = _final_model(RunConfig(clients=3, rounds=2), store)
    assert status == "finished"
    rows = store.node_rounds(rid)
    failed = [r for r in rows if r.status == "failed"]
    assert len(failed) == 2 and "lost its disk" in failed[0].reason
    assert all(r.num_clients == 3 for r in store.rounds(rid)[1:])


def test_controls_pause_add_rounds_stop(store, monkeypatch):
    cfg = RunConfig(clients=2, rounds=3)
    rid = store.create_run(cfg.model_dump())
    store.add_control(rid, "add_rounds", {"rounds": 2})
    seen, resumed = [], []
    polls = {"since_pause": None}
    real_pending = store.pending_controls

    def pending(run_id):
        # The run polls its controls between rounds, and keeps polling while it is paused.
        # Resume it on the third poll after the pause was asked for, noting which rounds had
        # been recorded by then: a pause that held leaves them at [0, 1]; one that did not
        # block let a round run between every two polls. No clock is involved.
        out = real_pending(run_id)
        if polls["since_pause"] is not None and not resumed:
            polls["since_pause"] += 1
            if polls["since_pause"] == 3:
                resumed.append((list(seen), store.get_run(rid).status))
                store.add_control(rid, "resume")
        return out

    monkeypatch.setattr(store, "pending_controls", pending)

    def listener(rnd, row):
        seen.append(rnd)
        if rnd == 1:
            store.add_control(rid, "pause")
            polls["since_pause"] = 0
        if rnd == 4:
            store.add_control(rid, "stop", actor="tester")

    status = run_inprocess(cfg, store=store, run_id=rid, listeners=[listener])
    assert status == "stopped"
    assert seen == [0, 1, 2, 3, 4]  # 3 rounds + 2 added, stopped after round 4 of 5
    assert resumed == [([0, 1], "paused")]  # the pause held the run after round 1 until the resume
    assert store.get_run(rid).total_rounds == 5
    kinds = [e.kind for e in store.events(rid)]
    assert "rounds_added" in kinds and "stopped" in kinds


def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "fedswarm", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=300)


def test_cli_sim_writes_result_and_runs_lists_it(tmp_path):
    out = tmp_path / "out"
    r = _cli("sim", "--clients", "6", "--rounds", "3", "--out", str(out), "--db", str(tmp_path / "s.db"),
             cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    res = json.loads((out / "result.json").read_text())
    assert set(res) >= {"run_id", "config", "rounds", "summary"}
    row = res["rounds"][-1]
    assert set(row) >= {"round", "train_loss", "test_loss", "test_accuracy", "bytes_up", "bytes_down", "wall_s",
                        "sim_time_s"}
    assert set(res["summary"]) >= {"final_test_accuracy", "best_test_accuracy", "total_bytes_up",
                                   "total_bytes_down", "wall_s"}
    assert (out / "accuracy.png").stat().st_size > 1000
    assert "final test accuracy" in r.stdout
    listing = _cli("runs", "--db", str(tmp_path / "s.db"), "--json", cwd=tmp_path)
    assert json.loads(listing.stdout)[0]["run_id"] == res["run_id"]


@pytest.mark.parametrize("args, needle", [
    (["--clients", "0"], "'clients'"),
    (["--set", "nope=1"], "unknown parameter 'nope'"),
    (["--strategy", "warp"], "unknown strategy 'warp'"),
    (["--partition", "dirichlet:-1"], "'partition'"),
    (["--engine", "warp"], "'inprocess', 'flower', 'array', 'batched' or 'clock'"),  # every registered engine
])
def test_cli_bad_input_is_one_line_exit_2(tmp_path, args, needle):
    r = _cli("sim", *args, "--db", str(tmp_path / "s.db"), cwd=tmp_path)
    assert r.returncode == 2
    assert needle in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_cli_strategies_json(tmp_path):
    r = _cli("strategies", "--json", cwd=tmp_path)
    cat = json.loads(r.stdout)
    assert "fedavg" in [s["name"] for s in cat["strategies"]]
    assert "digits-mlp" in [t["name"] for t in cat["tasks"]]
    assert "clients" in cat["config"]["properties"]
