"""Secure aggregation in a real deployment: a Flower SuperLink and 5 SuperNodes (``fedswarm
client``) on loopback, ``flwr run`` with ``secagg=true``. In round 2 one SuperNode is killed
with SIGKILL after the key-sharing stage: its neighbours' shares rebuild its mask key, the
round completes with the four others' sum, and the run (two rounds) finishes.

"After sharing" is known, not guessed: a node trains only inside the masked-input stage, which
follows the sharing stage, and the run's task (``tests.resume_helpers``) holds every training
step past round 1's and tells the test it is holding.
"""

from __future__ import annotations

import time

import pytest

from fedswarm.store import Store
from tests.deployment_helpers import ROOT, TASK, Deployment, one_run, status_of

# Known broken (docs/secagg.md, "Known problem"): 3 of 5 runs passed on a loaded 2-core machine; one
# failing run ended with round 2's model at chance accuracy after the killed node was recovered, cause
# not found. Left out of CI's slow set by its marker until that is fixed: `pytest -m known_broken`.
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.known_broken]


@pytest.mark.timeout(900)
def test_secagg_deployment_survives_a_supernode_killed_after_sharing(tmp_path, hold_dir):
    db = tmp_path / "store.db"
    n = 5
    dep = Deployment(tmp_path, f"{1 * 3 * n}:{hold_dir}")  # round 1 trains (3 steps a node); round 2 holds
    try:
        t0 = time.monotonic()
        dep.start(n)
        dep.flwr("run", str(ROOT), "test", "--run-config",
                 f"rounds=2 clients={n} local_epochs=3 batch_size=1000 seed=5 task='{TASK}' db='{db}' secagg=true")
        dep.wait(lambda: len(list(hold_dir.glob("held-*"))) == n, 600, interval=0.1, what="round 2's training")
        t1 = time.monotonic()
        run = one_run(db)
        store = Store(db)
        r1 = {r.round: r for r in store.rounds(run.id)}[1].metrics["secagg"]
        assert r1["participants"] == n and r1["recovered"] == 0 and "failed" not in r1
        dep.kill_node(2)  # SIGKILL inside round 2's masked-input stage: it shared its keys, sends no input
        (hold_dir / "release").write_text("")
        done = dep.wait(lambda: status_of(db, "finished", "failed"), 600, interval=0.5, what="the run finishing")
        print(f"secagg deployment: round 1 held after {t1 - t0:.0f} s, finished {time.monotonic() - t1:.0f} s later")
        rows = {r.round: r for r in store.rounds(run.id)}
        assert done.status == "finished", f"{done.error}\n{dep.logs()}"
        assert "failed" not in rows[2].metrics["secagg"], [(r.round, r.test_accuracy, r.metrics) for r in rows.values()]
        assert sorted(rows) == [0, 1, 2]
        r2 = rows[2].metrics["secagg"]
        assert "failed" not in r2, r2
        assert r2["nodes"]["share_keys"] == n and r2["nodes"]["masked_input"] == n - 1
        assert r2["dropped_after_sharing"] == 1 and r2["recovered"] == 1
        assert set(r2["bytes"]) == {"advertise", "share_keys", "masked_input", "unmask"}
        assert rows[2].test_accuracy > rows[0].test_accuracy + 0.2, [
            (r.round, r.test_accuracy, r.metrics.get("secagg")) for r in rows.values()]
    finally:
        dep.stop()
