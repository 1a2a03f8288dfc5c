"""A fault in a real deployment, a SuperNode killed mid-round: a Flower SuperLink and 3 SuperNodes on loopback;
one SuperNode is killed with SIGKILL in the middle of a round: the round completes with the
other two (FedAvg's minimum allows it; the round row and an event say so), and the node,
restarted, rejoins and trains in a later round. (The ServerApp killed and resumed:
tests/test_deployment_faults.py.)

"In the middle of a round" is known, not guessed: the run's task (``tests.resume_helpers``)
holds every training step past the rounds before, and tells the test it is holding.
"""

from __future__ import annotations

import pytest

from fedswarm.store import Store
from tests.deployment_helpers import Deployment, status_of

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.timeout(1200)
def test_supernode_killed_mid_round_round_completes_and_node_rejoins(tmp_path, hold_dir):
    db = tmp_path / "store.db"
    dep = Deployment(tmp_path, f"{1 * 3 * 3}:{hold_dir}")  # round 1 runs; round 2 holds on every node
    try:
        run, first = dep.run_until_round_2_holds(3, db, hold_dir)
        store = Store(db)
        dep.kill_node(2)  # SIGKILL, mid-round 2
        (hold_dir / "release").write_text("")
        dep.start_node(2, 3)  # the device comes back
        done = dep.wait(lambda: status_of(db, "finished", "failed"), 700, interval=0.5, what="the run finishing")
        assert done.status == "finished", f"{done.error}\n{dep.logs()}"
        rows = {r.round: r for r in store.rounds(run.id)}
        assert sorted(rows) == [0, 1, 2, 3]
        # round 2 completed with the other two; the store says a node failed and the minimum
        nodes2 = [n for n in store.node_rounds(run.id) if n.round == 2]
        failed = [n for n in nodes2 if n.status == "failed"]
        assert len(failed) == 1 and failed[0].node_id in first
        assert {n.node_id for n in nodes2 if n.status == "ok"} == first - {failed[0].node_id}
        assert rows[2].metrics["nodes_failed"] == 1 and rows[2].metrics["min_train_nodes"] == 1
        assert any(e.kind == "nodes_failed" for e in store.events(run.id))
        # the restarted node (a new node id) trained in a later round, with the two others
        later = [n for n in store.node_rounds(run.id) if n.round >= 3 and n.status == "ok"]
        rejoined = {n.node_id for n in later} - first
        assert len(rejoined) == 1, [(n.round, n.node_id, n.status) for n in store.node_rounds(run.id)]
        assert rows[3].num_clients == 3 and rows[3].metrics.get("nodes_failed") is None
        assert rows[3].test_accuracy > rows[0].test_accuracy + 0.2  # it trained (3 full-batch steps a round)
    finally:
        dep.stop()
