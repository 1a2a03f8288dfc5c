"""A Flower deployment on loopback for the fault tests (tests/test_deployment_faults.py,
tests/test_deployment_node_fault.py): a SuperLink and SuperNodes (``fedswarm client``) as
process groups, all stopped at the end, and readers of the run's store."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from fedswarm.server.checkpoint import load_latest
from fedswarm.procs import stop_process_groups
from fedswarm.store import Store
from fedswarm.wire import arrayrecord_to_vector
from tests.helpers import free_port, port_open, wait_until
from tests.resume_helpers import HOLD_ENV

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # flwr is a dependency: its commands sit beside this interpreter
TASK = "tests.resume_helpers:make_task"
RUN = "rounds=3 clients={n} local_epochs=3 batch_size=1000 seed=5 task='{task}' db='{db}'"


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


class Deployment:
    """A SuperLink and SuperNodes (``fedswarm client``) as process groups, all stopped at the end."""

    def __init__(self, tmp: Path, hold: str, *, pki: Path | None = None):
        """``pki``: a folder made by ``fedswarm certs init --supernodes N``; the SuperLink then
        runs with TLS and SuperNode authentication, node i uses ``supernodes/sn{i}.key``, and
        :meth:`start` registers every node's public key first (the README's "Deploy on real
        devices")."""
        self.tmp, self.pki = tmp, pki
        (tmp / "flwr").mkdir()
        self.port = free_port()
        link = (f'root-certificates = "{pki / "ca.pem"}"\n' if pki is not None else "insecure = true\n")
        (tmp / "flwr" / "config.toml").write_text(
            f'[superlink]\ndefault = "test"\n\n[superlink.test]\naddress = "127.0.0.1:{self.port}"\n{link}')
        self.env = dict(os.environ, FLWR_HOME=str(tmp / "flwr"), PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT),
                        FLWR_SUPEREXEC_TASK_POLL_INTERVAL="0.25",
                        PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", **{HOLD_ENV: hold})
        self.log_path = tmp / "processes.log"
        self.log = open(self.log_path, "w")
        self.procs: list[subprocess.Popen] = []
        self.nodes: dict[int, subprocess.Popen] = {}

    def _spawn(self, cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        p = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**self.env, **(env or {})},
                             start_new_session=True)
        self.procs.append(p)
        return p

    def superlink_command(self) -> list[str]:
        """The ``flower-superlink`` command line of this deployment (tests/test_flower_options.py
        holds its options to what the installed Flower accepts and does not deprecate)."""
        if self.pki is None:
            security = ["--insecure"]
        else:
            security = ["--ssl-ca-certfile", str(self.pki / "ca.pem"),
                        "--ssl-certfile", str(self.pki / "superlink" / "server.pem"),
                        "--ssl-keyfile", str(self.pki / "superlink" / "server.key"), "--enable-supernode-auth"]
        return [str(BIN / "flower-superlink"), *security, "--host", "127.0.0.1", "--port", str(self.port),
                "--database", str(self.tmp / "state.db"), "--disable-runtime-dependency-installation"]

    def start(self, num_nodes: int, devices: list[str | None] | None = None) -> None:
        """The SuperLink, then ``num_nodes`` SuperNodes; ``devices[i]``: node i's ``--device``."""
        self._spawn(self.superlink_command())
        wait_until(lambda: port_open("127.0.0.1", self.port), 60, interval=0.2, what="the SuperLink listening")
        if self.pki is not None:  # the operator registers the nodes' public keys
            for i in range(num_nodes):
                out = self.flwr("supernode", "register", str(self.pki / "supernodes" / f"sn{i}.pub"), "test")
                assert "registered" in out, out
        for i in range(num_nodes):
            self.start_node(i, num_nodes, devices[i] if devices else None)

    def start_node(self, i: int, n: int, device: str | None = None, env: dict[str, str] | None = None) -> None:
        """Start (or start again) node ``i`` of ``n``: the same partition, state folder and,
        in a secure deployment, the same authentication key every time; ``env``: more environment
        for its processes (e.g. ``FEDSWARM_FAKE_BATTERY``)."""
        if self.pki is None:
            security = ["--insecure"]
        else:
            security = ["--root-certificates", str(self.pki / "ca.pem"),
                        "--auth-key", str(self.pki / "supernodes" / f"sn{i}.key")]
        self.nodes[i] = self._spawn([sys.executable, "-m", "fedswarm", "client", "--superlink",
                                     f"127.0.0.1:{self.port}", *security, "--partition-id", str(i),
                                     "--num-partitions", str(n), "--device-class", "cpu",
                                     "--clientappio-port", str(free_port()),
                                     "--state-dir", str(self.tmp / f"node-state-{i}")]
                                    + (["--device", device] if device else []), env=env)

    def wait(self, pred, timeout: float, *, what: str, interval: float = 0.5):
        """``wait_until``, failing with the end of the processes' log."""
        try:
            return wait_until(pred, timeout, interval=interval, what=what)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.logs()}") from None

    def run_until_round_2_holds(self, n: int, db: Path, hold_dir: Path, run_config: str = "") -> tuple:
        """Start the SuperLink and ``n`` SuperNodes, ``flwr run`` fedswarm's app (``RUN`` plus
        ``run_config``), and wait until every node holds in round 2 (the task's hold, set at
        construction, must let round 1 through). Returns (the run, the ids of the nodes that
        trained round 1)."""
        self.start(n)
        self.flwr("run", str(ROOT), "test", "--run-config", RUN.format(n=n, task=TASK, db=db) + run_config)
        self.wait(lambda: len(list(hold_dir.glob("held-*"))) == n, 600, interval=0.1, what="round 2 in flight")
        run = one_run(db)
        first = {r.node_id for r in Store(db).node_rounds(run.id) if r.round == 1 and r.status == "ok"}
        assert len(first) == n, first
        return run, first

    @staticmethod
    def kill_serverapp(run) -> None:
        """SIGKILL the run's ServerApp process and wait until it is gone."""
        os.kill(run.pid, signal.SIGKILL)
        wait_until(lambda: not alive(run.pid), 60, what="the ServerApp gone")

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
        return self.logs_all()[-5000:]

    def logs_all(self) -> str:
        """Everything the processes printed so far."""
        self.log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        stop_process_groups(list(self.procs), grace_s=15)
        self.log.close()


def one_run(db: Path):
    if not db.exists():
        return None
    store = Store(db)
    try:
        runs = store.list_runs()
        return runs[0] if runs else None
    finally:
        store.close()


def status_of(db: Path, *statuses: str):
    run = one_run(db)
    return run if run is not None and run.status in statuses else None


def model_of(db: Path, run_id: str) -> torch.Tensor:
    return arrayrecord_to_vector(load_latest(Store(db), run_id).arrays)


def run_on_devices(tmp: Path, devices: list[str], rounds: int = 3, timeout_s: float = 300) -> dict:
    """A whole deployment on loopback with one SuperNode per entry of ``devices`` (its
    ``fedswarm client --device``): ``flwr run`` fedswarm's app for ``rounds`` rounds, wait
    until the run ends, stop everything. Returns the run's status, the clients of each
    round, and the device each node reported it trained on (``train_device`` of its probe)."""
    import time

    dep = Deployment(tmp, hold="")
    db = tmp / "store.db"
    t0 = time.perf_counter()
    try:
        dep.start(len(devices), devices)
        dep.flwr("run", str(ROOT), "test", "--run-config", f"rounds={rounds} clients={len(devices)} db='{db}'")
        run = dep.wait(lambda: status_of(db, "finished", "failed", "stopped"), timeout_s, what="the run ending")
        store = Store(db)
        try:
            done = [r for r in store.rounds(run.id) if r.round > 0]
            nodes = [n for n in store.list_nodes() if n.kind == "supernode"]
            return {"status": run.status, "rounds": len(done), "clients_per_round": [r.num_clients for r in done],
                    "test_accuracy": done[-1].test_accuracy if done else None,
                    "train_devices": sorted(str(n.info.get("train_device")) for n in nodes),
                    "wall_s": time.perf_counter() - t0}
        finally:
            store.close()
    finally:
        dep.stop()
