"""A fault in a real deployment, a node back only after the resume: the ServerApp and one SuperNode die together;
the run is resumed, and the device comes back only after the resumed server has asked the
nodes for their state. A Flower SuperLink and two SuperNodes (``fedswarm client
--state-dir``) on loopback, compressed_fedavg (top-k with error feedback: client state).

What must hold: the surviving node restores its residual from its own disk; the dead node
is not counted as restored; the node that comes back (a new Flower node id) is named once in
a ``client_resync`` event as late, is resynchronised by the protocol and trains; the run
finishes with every round recorded once. (Its model differs from an uninterrupted run's by
design: one node's residual is lost. The exact-model cases are in
tests/test_deployment_faults.py.)

"In the middle of a round" and "after the resume query" are known, not guessed: the run's
task (``tests.resume_helpers``) holds round 2's training until the test releases it, and
the node restarts only once the store has the ``resumed`` event, which the server writes
after the query's replies are in.
"""

from __future__ import annotations

import pytest

from fedswarm.store import Store
from tests.deployment_helpers import Deployment, alive, status_of

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.timeout(1200)  # ClientApp processes start per message, and a dead node is found by heartbeat
def test_a_node_back_after_the_resume_query_is_named_resynchronised_and_trains(tmp_path, hold_dir):
    db = tmp_path / "store.db"
    dep = Deployment(tmp_path, f"{1 * 2 * 3}:{hold_dir}")  # round 1 runs (2 nodes, 3 epochs); round 2 holds
    try:
        run, first = dep.run_until_round_2_holds(2, db, hold_dir, " strategy='compressed_fedavg'")
        assert run.pid and alive(run.pid)
        dep.kill_serverapp(run)  # the ServerApp, in the middle of round 2 ...
        dep.kill_node(1)  # ... and one device with it
        (hold_dir / "release").write_text("")  # the survivor finishes its round-2 work for the dead server
        out = dep.fedswarm("resume", run.id, "--db", str(db), "--federation", "test")
        assert "resumes on federation 'test'" in out

        def resumed():
            return [e for e in Store(db).events(run.id) if e.kind == "resumed"]

        (event,) = dep.wait(resumed, 600, interval=0.2, what="the resumed server's query answered")
        dep.start_node(1, 2)  # the device comes back after the query: a new node id, never asked
        done = dep.wait(lambda: status_of(db, "finished", "failed"), 700, interval=0.5, what="the resumed run")
        assert done.status == "finished", f"{done.error}\n{dep.logs()}"
        store = Store(db)
        assert [r.round for r in store.rounds(run.id)] == [0, 1, 2, 3]
        # the survivor restored its own state; the dead node (asked while the SuperLink still listed it,
        # or not at all once it had dropped it) restored nothing
        assert "restored from the nodes' own disks on 1 of " in event.message, event.message
        resync = [e for e in store.events(run.id) if e.kind == "client_resync"]
        late = [e for e in resync if e.data.get("late")]
        assert len(late) == 1, [e.message for e in resync]
        new_node, first_round = late[0].data["node_id"], late[0].data["first_round"]
        assert new_node not in first and "joined after the resume query" in late[0].message
        dead = [e for e in resync if not e.data.get("late")]
        assert all(e.data["node_id"] in first for e in dead), [e.message for e in resync]
        if "on 1 of 2 nodes" in event.message:  # it was asked: named as not answering
            assert len(dead) == 1 and "did not answer the resume query" in dead[0].message, [e.message for e in resync]
        rows = store.node_rounds(run.id)
        assert first_round in (2, 3)
        assert new_node in {n.node_id for n in rows if n.round == first_round and n.status == "ok"}
        # the last round: the survivor (its old node id) and the node that came back, both trained
        ok3 = {n.node_id for n in rows if n.round == 3 and n.status == "ok"}
        assert new_node in ok3 and len(ok3) == 2 and ok3 - {new_node} <= first, [
            (n.round, n.node_id, n.status) for n in rows]
    finally:
        dep.stop()
