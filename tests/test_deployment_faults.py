"""Faults in a real deployment (issue 15): a Flower SuperLink and SuperNodes on loopback.

- The ServerApp is killed with SIGKILL in the middle of a round; ``fedswarm resume RUN_ID
  --federation NAME`` continues the run on the same SuperLink and SuperNodes, in the same
  run and store: same final model as the same run uninterrupted (1e-5), each round once.
  For FedAvg (no client state) and for compressed_fedavg with error feedback, whose
  SuperNodes restore their residuals and replicas from their ``--state-dir`` (they finished
  the killed round for the dead server, so they also hold a newer snapshot than the
  checkpoint's round: the resume must take the checkpoint's), without
  ``--accept-client-state-loss``.
- One of 3 SuperNodes is killed with SIGKILL in the middle of a round: the round completes
  with the other two (FedAvg's minimum allows it; the round row and an event say so), and
  the node, restarted, rejoins and trains in a later round.

"In the middle of a round" is known, not guessed: the run's task (``tests.resume_helpers``)
holds every training step past the rounds before, and tells the test it is holding.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fedswarm.server.checkpoint import load_latest
from fedswarm.procs import stop_process_groups
from fedswarm.store import Store
from fedswarm.wire import arrayrecord_to_vector
from tests.helpers import free_port, port_open, wait_until
from tests.resume_helpers import HOLD_ENV

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # flwr is a dependency: its commands sit beside this interpreter
pytestmark = pytest.mark.integration
TASK = "tests.resume_helpers:make_task"


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


class Deployment:
    """A SuperLink and SuperNodes (``fedswarm client``) as process groups, all stopped at the end."""

    def __init__(self, tmp: Path, hold: str):
        self.tmp = tmp
        (tmp / "flwr").mkdir()
        self.port = free_port()
        (tmp / "flwr" / "config.toml").write_text(
            f'[superlink]\ndefault = "test"\n\n[superlink.test]\naddress = "127.0.0.1:{self.port}"\ninsecure = true\n')
        self.env = dict(os.environ, FLWR_HOME=str(tmp / "flwr"), PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT),
                        PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", **{HOLD_ENV: hold})
        self.log_path = tmp / "processes.log"
        self.log = open(self.log_path, "w")
        self.procs: list[subprocess.Popen] = []
        self.nodes: dict[int, subprocess.Popen] = {}

    def _spawn(self, cmd: list[str]) -> subprocess.Popen:
        p = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        self.procs.append(p)
        return p

    def start(self, num_nodes: int) -> None:
        self._spawn([str(BIN / "flower-superlink"), "--insecure", "--host", "127.0.0.1", "--port", str(self.port),
                     "--database", str(self.tmp / "state.db"), "--disable-runtime-dependency-installation"])
        wait_until(lambda: port_open("127.0.0.1", self.port), 60, interval=0.2, what="the SuperLink listening")
        for i in range(num_nodes):
            self.start_node(i, num_nodes)

    def start_node(self, i: int, n: int) -> None:
        self.nodes[i] = self._spawn([sys.executable, "-m", "fedswarm", "client", "--superlink",
                                     f"127.0.0.1:{self.port}", "--insecure", "--partition-id", str(i),
                                     "--num-partitions", str(n), "--device-class", "cpu",
                                     "--clientappio-port", str(free_port()),
                                     "--state-dir", str(self.tmp / f"node-state-{i}")])

    def kill_node(self, i: int) -> None:
        """SIGKILL the SuperNode and its ClientApp processes (its process group)."""
        p = self.nodes[i]
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=30)

    def flwr(self, *args: str) -> str:
        done = subprocess.run([str(BIN / "flwr"), *args], capture_output=True, text=True, env=self.env, timeout=180)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    def fedswarm(self, *args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "fedswarm", *args], capture_output=True, text=True,
                              env=self.env, timeout=180, cwd=ROOT)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    def logs(self) -> str:
        self.log.flush()
        return self.log_path.read_text()[-5000:]

    def stop(self) -> None:
        stop_process_groups(list(self.procs), grace_s=15)
        self.log.close()


@pytest.fixture
def hold_dir(tmp_path):
    d = tmp_path / "hold"
    d.mkdir()
    return d


def _one_run(db: Path):
    if not db.exists():
        return None
    store = Store(db)
    try:
        runs = store.list_runs()
        return runs[0] if runs else None
    finally:
        store.close()


def _status(db: Path, *statuses: str):
    run = _one_run(db)
    return run if run is not None and run.status in statuses else None


def _model(db: Path, run_id: str) -> torch.Tensor:
    return arrayrecord_to_vector(load_latest(Store(db), run_id).arrays)


RUN = "rounds=3 clients={n} local_epochs=3 batch_size=1000 seed=5 task='{task}' db='{db}'"


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
    # the same run, uninterrupted, on the in-process engine (same seed, same model: DESIGN.md)
    reference = subprocess.Popen([sys.executable, "-m", "fedswarm", "sim", "--task", TASK, "--clients", "2",
                                  "--rounds", "3", "--local-epochs", "3", "--batch-size", "1000", "--seed", "5",
                                  "--db", str(ref_db), *sim_args],
                                 cwd=ROOT, env={k: v for k, v in dep.env.items() if k != HOLD_ENV},
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        dep.start(2)
        dep.flwr("run", str(ROOT), "test", "--run-config", RUN.format(n=2, task=TASK, db=db) + run_config)
        try:
            wait_until(lambda: list(hold_dir.glob("held-*")), 600, interval=0.1, what="round 2 in flight")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{dep.logs()}") from None
        run = _one_run(db)
        assert run.status == "running" and [r.round for r in Store(db).rounds(run.id)] == [0, 1]
        assert Store(db).latest_checkpoint(run.id).round == 1 and run.pid and _alive(run.pid)
        os.kill(run.pid, signal.SIGKILL)  # the ServerApp process, in the middle of round 2
        wait_until(lambda: not _alive(run.pid), 60, what="the ServerApp gone")
        (hold_dir / "release").write_text("")  # the clients finish their round-2 work for a dead server
        assert _one_run(db).status == "running"  # SIGKILL: nothing recorded the death
        out = dep.fedswarm("resume", run.id, "--db", str(db), "--federation", "test")
        assert "resumes on federation 'test'" in out
        try:
            done = wait_until(lambda: _status(db, "finished", "failed"), 600, interval=0.5, what="the resumed run")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{dep.logs()}") from None
        assert done.status == "finished", f"{done.error}\n{dep.logs()}"
        out, _ = reference.communicate(timeout=600)
        assert reference.returncode == 0, out[-3000:]
        store, ref_store = Store(db), Store(ref_db)
        assert [r.round for r in store.rounds(run.id)] == [0, 1, 2, 3]
        assert all(r.num_clients == 2 for r in store.rounds(run.id) if r.round > 0)
        (ref,) = ref_store.list_runs()
        torch.testing.assert_close(_model(db, run.id), _model(ref_db, ref.id), rtol=0, atol=1e-5)
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


@pytest.mark.timeout(1200)
def test_supernode_killed_mid_round_round_completes_and_node_rejoins(tmp_path, hold_dir):
    db = tmp_path / "store.db"
    dep = Deployment(tmp_path, f"{1 * 3 * 3}:{hold_dir}")  # round 1 runs; round 2 holds on every node
    try:
        dep.start(3)
        dep.flwr("run", str(ROOT), "test", "--run-config", RUN.format(n=3, task=TASK, db=db))
        try:
            wait_until(lambda: len(list(hold_dir.glob("held-*"))) == 3, 600, interval=0.1, what="round 2 in flight")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{dep.logs()}") from None
        run = _one_run(db)
        store = Store(db)
        first = {n.node_id for n in store.node_rounds(run.id) if n.round == 1 and n.status == "ok"}
        assert len(first) == 3
        dep.kill_node(2)  # SIGKILL, mid-round 2
        (hold_dir / "release").write_text("")
        dep.start_node(2, 3)  # the device comes back
        try:
            done = wait_until(lambda: _status(db, "finished", "failed"), 700, interval=0.5, what="the run finishing")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{dep.logs()}") from None
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
