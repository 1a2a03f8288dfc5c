"""A live run whose process is gone is ``lost``, for ``fedswarm runs`` as for the dashboard: the
run records its process (pid, host, start) when it starts, and the one rule
(:func:`fedswarm.store.liveness.lost_reason`) checks it."""

import contextlib
import datetime as dt
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from fedswarm.procs import process_start
from fedswarm.store import Store, migrate
from fedswarm.store.liveness import Heartbeat, lost_reason, owner_fields
from tests.helpers import wait_until
from tests.resume_helpers import HOLD_ENV

ROOT = Path(__file__).resolve().parents[1]


def test_a_reused_pid_or_a_dead_one_is_lost_another_hosts_is_not_judged(store):
    rid = store.create_run({}, status="running")
    store.update_run(rid, **owner_fields())
    assert lost_reason(store.get_run(rid)) is None  # this process: alive
    store.update_run(rid, pid_start="another-boot:1")  # the pid now names a later process
    assert "belongs to another process" in lost_reason(store.get_run(rid))
    store.update_run(rid, host=f"not-{socket.gethostname()}")
    assert lost_reason(store.get_run(rid)) is None  # on another machine and no heartbeat: not judged from here
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    store.update_run(rid, **owner_fields(child.pid))
    assert owner_fields(child.pid)["pid_start"] is None  # gone already: /proc has no start for it
    assert f"its process {child.pid} is gone" in lost_reason(store.get_run(rid))
    store.set_status(rid, "failed")
    assert lost_reason(store.get_run(rid)) is None  # only a live run can be lost
    assert process_start(os.getpid()) == process_start(os.getpid()) is not None


def test_a_run_on_another_host_is_judged_by_its_heartbeat(store):
    rid = store.create_run({}, status="running")
    store.update_run(rid, **{**owner_fields(), "host": f"not-{socket.gethostname()}"})
    now = dt.datetime(2026, 11, 28, 12, 0, 0)

    def why(beat_s_ago: float | None, **fields):
        store.update_run(rid, last_report_at=None if beat_s_ago is None else now - dt.timedelta(seconds=beat_s_ago),
                         **fields)
        return lost_reason(store.get_run(rid), 120.0, now)

    assert why(None) is None  # a fedswarm without heartbeats: taken as live
    assert why(119) is None
    assert "written no heartbeat for over 120 s (last at 2026-11-28 11:57:59 UTC)" in why(121)
    assert f"its process {os.getpid()} on not-" in why(121)
    assert why(31, lost_after_s=30.0) is not None and why(29) is None  # the run's own timeout
    store.set_status(rid, "finished")
    assert why(10_000) is None  # only a live run can be lost


def test_the_heartbeat_beats_until_left_and_outlives_a_failed_write(store, monkeypatch):
    rid = store.create_run({}, status="running")
    with Heartbeat(store, rid, every_s=0.02) as hb:
        first = store.get_run(rid).last_report_at
        assert first is not None  # written on entry, before the first interval
        wait_until(lambda: store.get_run(rid).last_report_at > first, 30, interval=0.01, what="a second beat")
    assert not hb._thread.is_alive()

    class Flaky:  # the store refuses one write: the beats go on
        calls, ok = 0, threading.Event()

        def update_run(self, run_id, **fields):
            Flaky.calls += 1
            if Flaky.calls == 2:
                raise OSError("database is locked")
            if Flaky.calls >= 4:
                Flaky.ok.set()

    with Heartbeat(Flaky(), rid, every_s=0.01):
        assert Flaky.ok.wait(30)
    monkeypatch.setenv("FEDSWARM_HEARTBEAT_S", "soon")
    with pytest.raises(ValueError, match="FEDSWARM_HEARTBEAT_S must be a number of seconds, got 'soon'"):
        Heartbeat(store, rid)
    with pytest.raises(ValueError, match="positive, finite"):
        Heartbeat(store, rid, every_s=0)


def test_migrate_gives_an_old_store_the_owner_columns(tmp_path):
    store = Store(tmp_path / "old.db")
    rid = store.create_run({}, status="running")
    with store.engine.begin() as conn:  # a store made before runs recorded their host and process start
        for col in ("host", "pid_start"):
            conn.exec_driver_sql(f"ALTER TABLE runs DROP COLUMN {col}")
    migrate(store.engine)
    store.update_run(rid, **owner_fields())
    assert lost_reason(store.get_run(rid)) is None and store.get_run(rid).host == socket.gethostname()
    store.close()


def _runs_json(db: Path, env: dict) -> list[dict]:
    out = subprocess.run([sys.executable, "-m", "fedswarm", "runs", "--db", str(db), "--json"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@contextlib.contextmanager
def _held_sim(db: Path, env: dict, hold_dir: Path):
    """`fedswarm sim` on ``db`` started and held in its first training step (the test task
    tells the test so), then SIGKILLed when the block ends; killed whatever happens."""
    victim = subprocess.Popen([sys.executable, "-m", "fedswarm", "sim", "--task", "tests.resume_helpers:make_task",
                               "--clients", "2", "--rounds", "2", "--local-steps", "1", "--db", str(db)],
                              cwd=ROOT, env=dict(env, **{HOLD_ENV: f"0:{hold_dir}"}), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        held = wait_until(lambda: list(hold_dir.glob("held-*")) or victim.poll() is not None, 300,
                          what="the run holding in its first training step")
        assert held is not True and victim.poll() is None, victim.communicate()[0][-3000:]
        yield victim
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(timeout=60)
    finally:
        if victim.poll() is None:
            os.killpg(victim.pid, signal.SIGKILL)
            victim.wait()
        victim.stdout.close()


def test_fedswarm_runs_shows_a_sigkilled_run_as_lost(tmp_path, hold_dir):
    """`fedswarm sim` holds in its first training step; `fedswarm runs` lists it running; after
    SIGKILL the store still says running (nothing could record the death), and `fedswarm runs`
    lists it lost, naming the process."""
    db = tmp_path / "run.db"
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    with _held_sim(db, env, hold_dir) as victim:
        (row,) = _runs_json(db, env)
        assert (row["status"], row["lost_reason"]) == ("running", None)
    store = Store(db)
    assert store.get_run(row["run_id"]).status == "running"
    store.close()
    (row,) = _runs_json(db, env)
    assert row["status"] == "lost" and f"its process {victim.pid} is gone" in row["lost_reason"]
    table = subprocess.run([sys.executable, "-m", "fedswarm", "runs", "--db", str(db)], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=300)
    assert " lost " in table.stdout and " running " not in table.stdout


def test_a_sigkilled_run_on_another_host_is_lost_once_its_heartbeat_stops(tmp_path, hold_dir):
    """The store as a second machine sees it: the run's host is not this one, so its pid says
    nothing here. While `fedswarm sim` holds in training its heartbeat keeps it running; after
    SIGKILL the heartbeat stops and `fedswarm runs` lists it lost, naming the host."""
    db = tmp_path / "run.db"
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", FEDSWARM_HEARTBEAT_S="0.2")
    store = Store(db)
    try:
        with _held_sim(db, env, hold_dir) as victim:
            (rid,) = [r["run_id"] for r in _runs_json(db, env)]
            store.update_run(rid, host="another-machine", lost_after_s=3.0)
            seen = store.get_run(rid).last_report_at or dt.datetime.min
            wait_until(lambda: (store.get_run(rid).last_report_at or dt.datetime.min) > seen, 60,
                       what="a heartbeat while held in training")
            (row,) = _runs_json(db, env)
            assert (row["status"], row["lost_reason"]) == ("running", None)
    finally:
        store.close()
    row = wait_until(lambda: (r := _runs_json(db, env)[0])["status"] == "lost" and r, 120,
                     what="the run shown lost once its heartbeat is older than 3 s")
    assert f"its process {victim.pid} on another-machine has written no heartbeat for over 3 s" in row["lost_reason"]
