"""A flaky link in a real deployment: a Flower SuperLink and 3 SuperNodes on loopback;
one SuperNode is frozen with SIGSTOP in the middle of round 2 (its link gone: it neither answers
nor closes) for longer than the round's timeout (run config ``round_timeout``): round 2 completes
with the other two and names the frozen node as failed; when it is let go (SIGCONT, no restart:
the same node id) it trains again in a later round, and the final round's federated evaluation
counts it.

"In the middle of a round" is known, not guessed: the run's task (``tests.resume_helpers``)
holds every training step past round 1 until the test releases it. (A SuperNode killed and
restarted: tests/test_deployment_node_fault.py.)
"""

from __future__ import annotations

import os
import signal

import pytest

from fedswarm.store import Store
from tests.deployment_helpers import ROOT, TASK, Deployment, one_run, status_of

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# Long enough for a healthy round on a loaded machine (a ClientApp process starts per message: rounds of up
# to ~55 s seen on 2 busy cores), short enough for a test: the frozen node costs round 2 this long.
ROUND_TIMEOUT_S = 120
RUN = ("rounds=4 clients=3 local_epochs=3 batch_size=1000 seed=5 eval_every=4 "
       f"round_timeout={ROUND_TIMEOUT_S}.0 task='{TASK}' db='{{db}}'")


@pytest.mark.timeout(900)
def test_frozen_supernode_is_named_failed_and_trains_again_without_a_restart(tmp_path, hold_dir):
    db = tmp_path / "store.db"
    dep = Deployment(tmp_path, f"{1 * 3 * 3}:{hold_dir}")  # round 1 runs (3 nodes, 3 full-batch steps); round 2 holds
    frozen = None
    try:
        dep.start(3)
        dep.flwr("run", str(ROOT), "test", "--run-config", RUN.format(db=db))
        dep.wait(lambda: len(list(hold_dir.glob("held-*"))) == 3, 600, interval=0.1, what="round 2 in flight")
        run = one_run(db)
        store = Store(db)
        first = {r.node_id for r in store.node_rounds(run.id) if r.round == 1 and r.status == "ok"}
        assert len(first) == 3, (first, _dump(store, run.id), dep.logs())
        frozen = dep.nodes[2].pid
        os.killpg(frozen, signal.SIGSTOP)  # the link is gone: nothing answers, nothing closes
        (hold_dir / "release").write_text("")
        dep.wait(lambda: any(r.round == 2 for r in store.rounds(run.id)), 300, interval=0.2,
                 what="round 2 done without the frozen node")
        os.killpg(frozen, signal.SIGCONT)  # the link is back; the node was never restarted
        done = dep.wait(lambda: status_of(db, "finished", "failed"), 600, interval=0.5, what="the run finishing")
        assert done.status == "finished", f"{done.error}\n{dep.logs()}"
        print(_dump(store, run.id))
        rows = {r.round: r for r in store.rounds(run.id)}
        assert sorted(rows) == [0, 1, 2, 3, 4]
        nodes = store.node_rounds(run.id)
        round2 = [n for n in nodes if n.round == 2]
        failed = [n for n in round2 if n.status == "failed"]
        assert len(failed) == 1 and failed[0].node_id in first, [(n.node_id, n.status, n.reason) for n in round2]
        assert {n.node_id for n in round2 if n.status == "ok"} == first - {failed[0].node_id}
        assert rows[2].metrics["nodes_failed"] == 1
        # the same node (same id: no restart) trained again in a later round
        again = [n for n in nodes if n.round >= 3 and n.node_id == failed[0].node_id and n.status == "ok"]
        assert again, [(n.round, n.node_id, n.status, n.reason) for n in nodes]
        # the final round's federated evaluation: every node that trained it scored the model
        last = [n for n in nodes if n.round == 4 and n.status == "ok"]
        assert rows[4].fed_examples == sum(n.fed_examples for n in last) and rows[4].fed_accuracy > 0.5
        assert all(n.telemetry and n.telemetry["train_s"] > 0 for n in last)
    finally:
        if frozen is not None:
            try:
                os.killpg(frozen, signal.SIGCONT)  # a stopped group would not act on the stop's SIGTERM
            except ProcessLookupError:
                pass
        dep.stop()


def _dump(store: Store, run_id: str) -> str:
    """The run's rounds and node rounds, for a failure's message."""
    lines = [f"round {r.round}: wall {r.wall_s:.1f} s, {r.num_clients} nodes, {r.metrics.get('nodes_failed')} failed"
             for r in store.rounds(run_id)]
    lines += [f"  round {n.round} node {n.node_id}: {n.status} {(n.reason or '')[:80]}"
              for n in store.node_rounds(run_id)]
    return "\n".join(lines)
