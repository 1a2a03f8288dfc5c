"""A live run whose process is gone is ``lost``, for ``fedswarm runs`` as for the dashboard: the
run records its process (pid, host, start) when it starts, and the one rule
(:func:`fedswarm.store_liveness.lost_reason`) checks it."""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from fedswarm.procs import process_start
from fedswarm.store import Store, migrate
from fedswarm.store_liveness import lost_reason, owner_fields
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
    assert lost_reason(store.get_run(rid)) is None  # its process is on another machine: not seen from here
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    store.update_run(rid, **owner_fields(child.pid))
    assert owner_fields(child.pid)["pid_start"] is None  # gone already: /proc has no start for it
    assert f"its process {child.pid} is gone" in lost_reason(store.get_run(rid))
    store.set_status(rid, "failed")
    assert lost_reason(store.get_run(rid)) is None  # only a live run can be lost
    assert process_start(os.getpid()) == process_start(os.getpid()) is not None


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


def test_fedswarm_runs_shows_a_sigkilled_run_as_lost(tmp_path, hold_dir):
    """`fedswarm sim` holds in its first training step (the test task tells the test so); `fedswarm
    runs` lists it running; after SIGKILL the store still says running (nothing could record the
    death), and `fedswarm runs` lists it lost, naming the process."""
    db = tmp_path / "run.db"
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", **{HOLD_ENV: f"0:{hold_dir}"})
    victim = subprocess.Popen([sys.executable, "-m", "fedswarm", "sim", "--task", "tests.resume_helpers:make_task",
                               "--clients", "2", "--rounds", "2", "--local-steps", "1", "--db", str(db)],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    try:
        held = wait_until(lambda: list(hold_dir.glob("held-*")) or victim.poll() is not None, 300,
                          what="the run holding in its first training step")
        assert held is not True and victim.poll() is None, victim.communicate()[0][-3000:]
        env.pop(HOLD_ENV)
        (row,) = _runs_json(db, env)
        assert (row["status"], row["lost_reason"]) == ("running", None)
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(timeout=60)
    finally:
        if victim.poll() is None:
            os.killpg(victim.pid, signal.SIGKILL)
            victim.wait()
        victim.stdout.close()
    store = Store(db)
    assert store.get_run(row["run_id"]).status == "running"
    store.close()
    (row,) = _runs_json(db, env)
    assert row["status"] == "lost" and f"its process {victim.pid} is gone" in row["lost_reason"]
    table = subprocess.run([sys.executable, "-m", "fedswarm", "runs", "--db", str(db)], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=300)
    assert " lost " in table.stdout and " running " not in table.stdout
