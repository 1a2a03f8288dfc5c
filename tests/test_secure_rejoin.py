"""Rejoin after a restart on a secure deployment (Flower issue #4844's ask): a real SuperLink
with TLS and SuperNode authentication, two registered SuperNodes made by ``fedswarm certs``.
One SuperNode is killed with SIGKILL in the middle of round 2 and started again with the same
authentication key and the same state folder, the SuperLink left running. The SuperLink still
holds the dead session for two heartbeats and refuses the restart ("Failed to activate
SuperNode"); ``fedswarm client --rejoin-wait`` starts it again until it is accepted under its
key's node id, and it trains in round 3 (round 2 completes either way). "In the middle of a
round" is known, not guessed: the run's task (``tests.resume_helpers``) holds every training
step past round 1 and tells the test so."""

from __future__ import annotations

import re
import subprocess

import pytest

from fedswarm.store import Store
from tests.deployment_helpers import BIN, Deployment, status_of

pytestmark = [pytest.mark.integration, pytest.mark.slow]


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
        # With node authentication the node id is the key's: the SuperLink activated the
        # restarted device under the id it had before (its log names that id twice).
        activated = re.findall(r"Activated node_id=(\d+)", dep.logs_all())
        again = {i for i in activated if activated.count(i) > 1}
        assert len(again) == 1 and again <= first, activated
        (rejoined,) = again
        # round 2 completed (the survivor's reply; the restarted node's too if it came back in
        # time to pull its message), and the restarted node trained in round 3
        round2 = {n.node_id: n.status for n in node_rounds if n.round == 2}
        assert list(round2.values()).count("ok") >= 1, round2
        round3 = {n.node_id: n.status for n in node_rounds if n.round == 3}
        assert round3.get(rejoined) == "ok", [(n.round, n.node_id, n.status) for n in node_rounds]
        assert dep.nodes[1].poll() is None, "the restarted SuperNode exited"
    finally:
        dep.stop()
