"""Faults in a real deployment, server and nodes killed and resumed: a Flower SuperLink and SuperNodes on loopback.

- The ServerApp is killed with SIGKILL in the middle of a round; ``fedswarm resume RUN_ID
  --federation NAME`` continues the run on the same SuperLink and SuperNodes, in the same
  run and store: same final model as the same run uninterrupted (1e-5), each round once.
  For FedAvg (no client state) and for compressed_fedavg with error feedback, whose
  SuperNodes restore their residuals and replicas from their ``--state-dir`` (they finished
  the killed round for the dead server, so they also hold a newer snapshot than the
  checkpoint's round: the resume must take the checkpoint's), without
  ``--accept-client-state-loss``.
- (A SuperNode killed mid-round: tests/test_deployment_node_fault.py; the ServerApp and a
  SuperNode killed together, the node back after the resume query:
  tests/test_deployment_late_node.py. Each in its own file so that pytest-xdist's
  ``--dist loadfile`` runs them side by side.)

"In the middle of a round" is known, not guessed: the run's task (``tests.resume_helpers``)
holds every training step past the rounds before, and tells the test it is holding.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

from fedswarm.store import Store
from tests.deployment_helpers import (
    HOLD_ENV, RUN, ROOT, TASK, Deployment, alive, model_of, one_run, status_of)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


#: strategy -> (its `fedswarm sim` options, its `flwr run --run-config` keys)
STRATEGIES = {
    "fedavg": ([], ""),
    # its defaults: the topk codec with error feedback (a deployment's run config cannot set params.*)
    "compressed_fedavg": (["--strategy", "compressed_fedavg"], " strategy='compressed_fedavg'"),
}


@pytest.mark.timeout(1200)  # ClientApp processes start per message: slow on a loaded machine
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_serverapp_killed_mid_round_resumes_on_the_superlink(tmp_path, hold_dir, strategy):
    db, ref_db = tmp_path / "store.db", tmp_path / "ref.db"
    sim_args, run_config = STRATEGIES[strategy]
    steps_before = 1 * 2 * 3  # round 1, two nodes, three full-batch epochs: round 2 holds
    dep = Deployment(tmp_path, f"{steps_before}:{hold_dir}")
    # the same run, uninterrupted, on the in-process engine (same seed, same model: docs/architecture.md)
    reference = subprocess.Popen([sys.executable, "-m", "fedswarm", "sim", "--task", TASK, "--clients", "2",
                                  "--rounds", "3", "--local-epochs", "3", "--batch-size", "1000", "--seed", "5",
                                  "--db", str(ref_db), *sim_args],
                                 cwd=ROOT, env={k: v for k, v in dep.env.items() if k != HOLD_ENV},
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        dep.start(2)
        dep.flwr("run", str(ROOT), "test", "--run-config", RUN.format(n=2, task=TASK, db=db) + run_config)
        dep.wait(lambda: list(hold_dir.glob("held-*")), 600, interval=0.1, what="round 2 in flight")
        run = one_run(db)
        assert run.status == "running" and [r.round for r in Store(db).rounds(run.id)] == [0, 1]
        assert Store(db).latest_checkpoint(run.id).round == 1 and run.pid and alive(run.pid)
        dep.kill_serverapp(run)  # the ServerApp process, in the middle of round 2
        (hold_dir / "release").write_text("")  # the clients finish their round-2 work for a dead server
        assert one_run(db).status == "running"  # SIGKILL: nothing recorded the death
        out = dep.fedswarm("resume", run.id, "--db", str(db), "--federation", "test")
        assert "resumes on federation 'test'" in out
        done = dep.wait(lambda: status_of(db, "finished", "failed"), 600, interval=0.5, what="the resumed run")
        assert done.status == "finished", f"{done.error}\n{dep.logs()}"
        out, _ = reference.communicate(timeout=600)
        assert reference.returncode == 0, out[-3000:]
        store, ref_store = Store(db), Store(ref_db)
        assert [r.round for r in store.rounds(run.id)] == [0, 1, 2, 3]
        assert all(r.num_clients == 2 for r in store.rounds(run.id) if r.round > 0)
        (ref,) = ref_store.list_runs()
        torch.testing.assert_close(model_of(db, run.id), model_of(ref_db, ref.id), rtol=0, atol=1e-5)
        (event,) = [e for e in store.events(run.id) if e.kind == "resumed"]
        if strategy == "compressed_fedavg":
            assert "restored from the nodes' own disks on 2 of 2 nodes" in event.message, event.message
            assert not [e for e in store.events(run.id) if e.kind == "client_resync"]
        assert not [n for n in store.node_rounds(run.id) if n.status != "ok"]
    finally:
        if reference.poll() is None:
            os.killpg(reference.pid, signal.SIGKILL)
            reference.wait()
        dep.stop()
