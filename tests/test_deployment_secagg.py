"""Secure aggregation in a real deployment: a Flower SuperLink and 5 SuperNodes (``fedswarm
client``) on loopback, ``flwr run`` with ``secagg=true`` for one round. Inside that round one
SuperNode is killed with SIGKILL after the key-sharing stage: its neighbours' shares rebuild its
mask key, the round completes with the four others' sum, and the run finishes.

"After sharing" is known, not guessed: a node trains only inside the masked-input stage, which
follows the sharing stage, and the run's task (``tests.resume_helpers``) holds every training
step and tells the test it is holding. Most of the test's time is Flower's: a SuperNode polls
for its next message every 3 s, each stage's message starts a ClientApp process, and the
SuperLink declares the killed node gone only when two 30 s heartbeats are missed.
"""

from __future__ import annotations

import time

import pytest

from fedswarm.store import Store
from tests.deployment_helpers import ROOT, TASK, Deployment, one_run, status_of

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.timeout(900)
def test_secagg_deployment_survives_a_supernode_killed_after_sharing(tmp_path, hold_dir):
    db = tmp_path / "store.db"
    n = 5
    dep = Deployment(tmp_path, f"0:{hold_dir}")  # every training step holds until the test releases it
    try:
        t0 = time.monotonic()
        dep.start(n)
        dep.flwr("run", str(ROOT), "test", "--run-config",
                 f"rounds=1 clients={n} local_epochs=3 batch_size=1000 seed=5 task='{TASK}' db='{db}' secagg=true")
        dep.wait(lambda: len(list(hold_dir.glob("held-*"))) == n, 600, interval=0.1, what="the round's training")
        t1 = time.monotonic()
        run = one_run(db)
        dep.kill_node(2)  # SIGKILL inside the masked-input stage: it shared its keys, sends no input
        (hold_dir / "release").write_text("")
        done = dep.wait(lambda: status_of(db, "finished", "failed"), 600, interval=0.5, what="the run finishing")
        print(f"secagg deployment: training held after {t1 - t0:.0f} s, finished {time.monotonic() - t1:.0f} s later")
        rows = {r.round: r for r in Store(db).rounds(run.id)}
        assert done.status == "finished", f"{done.error}\n{dep.logs()}"
        assert sorted(rows) == [0, 1]
        r1 = rows[1].metrics["secagg"]
        assert "failed" not in r1, r1
        assert r1["nodes"] == {"advertise": n, "share_keys": n, "masked_input": n - 1, "unmask": n - 1}, r1
        assert r1["dropped_after_sharing"] == 1 and r1["recovered"] == 1 and "bad_shares" not in r1, r1
        assert len(r1["refused"]) == 1, r1  # the killed node's message, answered by the SuperLink
        assert set(r1["bytes"]) == {"advertise", "share_keys", "masked_input", "unmask"}
        # one round of 3 steps on 4 nodes: 0.13 -> 0.24 here (a corrupt aggregate lands at chance, ~0.1)
        assert rows[1].test_accuracy > rows[0].test_accuracy + 0.05, [
            (r.round, r.test_accuracy, r.metrics.get("secagg")) for r in rows.values()]
    finally:
        dep.stop()
