"""Rejoin after a restart on a secure deployment (Flower issue #4844's ask): a real SuperLink
with TLS and SuperNode authentication, two registered SuperNodes made by ``fedswarm certs``.
One SuperNode is killed with SIGKILL in the middle of round 2 and started again with the same
authentication key and the same state folder, the SuperLink left running: the round completes
with the other node, and the restarted one is accepted again (its key is still registered)
and trains in round 3. "In the middle of a round" is known, not guessed: the run's task
(``tests.resume_helpers``) holds every training step past round 1 and tells the test so."""

from __future__ import annotations

import subprocess

import pytest

from fedswarm.store import Store
from tests.deployment_helpers import BIN, Deployment, status_of

pytestmark = pytest.mark.integration


@pytest.mark.timeout(1200)
def test_restarted_supernode_rejoins_tls_auth_superlink_and_trains(tmp_path, hold_dir):
    pki, db = tmp_path / "pki", tmp_path / "store.db"
    made = subprocess.run([str(BIN / "fedswarm"), "certs", "init", "--out", str(pki), "--host", "localhost",
                           "--host", "127.0.0.1", "--supernodes", "2"], capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stdout + made.stderr
    dep = Deployment(tmp_path, f"{1 * 2 * 3}:{hold_dir}", pki=pki)  # round 1 runs (2 nodes, 3 epochs); 2 holds
    try:
        run, first = dep.run_until_round_2_holds(2, db, hold_dir)
        dep.kill_node(1)  # SIGKILL, mid-round 2
        (hold_dir / "release").write_text("")
        dep.start_node(1, 2)  # the device comes back: same key, same state folder, same SuperLink
        done = dep.wait(lambda: status_of(db, "finished", "failed"), 700, interval=0.5, what="the run finishing")
        assert done.status == "finished", f"{done.error}\n{dep.logs()}"
        store = Store(db)
        try:
            rows = {r.round: r for r in store.rounds(run.id)}
            node_rounds = store.node_rounds(run.id)
        finally:
            store.close()
        assert sorted(rows) == [0, 1, 2, 3]
        round2 = [n for n in node_rounds if n.round == 2]
        assert sum(n.status == "failed" for n in round2) == 1 and sum(n.status == "ok" for n in round2) == 1
        # round 3: two nodes trained, and one of them is the restarted device (it may come back
        # under its old node id or a new one: either way it is not the survivor of round 2)
        survivor = {n.node_id for n in round2 if n.status == "ok"}
        round3 = [n for n in node_rounds if n.round == 3 and n.status == "ok"]
        assert len(round3) == 2 and rows[3].num_clients == 2, [(n.round, n.node_id, n.status) for n in node_rounds]
        assert {n.node_id for n in round3} - survivor, "the restarted node did not train in round 3"
        assert rows[3].test_accuracy > rows[0].test_accuracy + 0.2  # it trained
        assert dep.nodes[1].poll() is None, "the restarted SuperNode exited"
    finally:
        dep.stop()
