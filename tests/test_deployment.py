"""A real Flower SuperLink and two SuperNodes on loopback run fedswarm's Flower App."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedswarm.store import Store
from tests.helpers import runs_ended, free_port, port_open, wait_until

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # flwr is a dependency: its commands sit beside this interpreter
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]  # a loaded 2-core machine: minutes


def _spawn(cmd, log, env):
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _stop(procs):
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()


def test_superlink_two_supernodes_two_rounds(tmp_path):
    env = dict(os.environ, FLWR_HOME=str(tmp_path / "flwr"), PYTHONUNBUFFERED="1",
               FLWR_SUPEREXEC_TASK_POLL_INTERVAL="0.25",
               PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")  # Flower starts its own helpers by name
    (tmp_path / "flwr").mkdir()
    port = free_port()
    (tmp_path / "flwr" / "config.toml").write_text(
        f'[superlink]\ndefault = "test"\n\n[superlink.test]\naddress = "127.0.0.1:{port}"\ninsecure = true\n'
    )
    db = tmp_path / "store.db"
    procs = []
    log = open(tmp_path / "processes.log", "w")
    try:
        procs.append(_spawn([str(BIN / "flower-superlink"), "--insecure", "--host", "127.0.0.1", "--port", str(port),
                             "--database", str(tmp_path / "state.db"),
                             "--disable-runtime-dependency-installation"], log, env))
        wait_until(lambda: port_open("127.0.0.1", port), 60, interval=0.2, what="the SuperLink listening")
        for i in range(2):
            cmd = [sys.executable, "-m", "fedswarm", "client", "--superlink", f"127.0.0.1:{port}", "--insecure",
                   "--partition-id", str(i), "--num-partitions", "2", "--device-class", "cpu",
                   "--clientappio-port", str(free_port()), "--state-dir", str(tmp_path / f"node-state-{i}")]
            procs.append(_spawn(cmd, log, env))
        started = subprocess.run(
            [str(BIN / "flwr"), "run", str(ROOT), "test", "--run-config", f"rounds=2 clients=2 db='{db}'"],
            capture_output=True, text=True, env=env, timeout=120,
        )
        assert started.returncode == 0, started.stdout + started.stderr

        def ended():
            return runs_ended(db)

        try:
            runs = wait_until(ended, 240, interval=0.5, what="the run finishing")
        except AssertionError as exc:
            log.flush()
            raise AssertionError(f"{exc}\n{(tmp_path / 'processes.log').read_text()[-4000:]}") from None
        log.flush()
        store = Store(db)
        rounds = store.rounds(runs[0].id)
        assert runs and runs[0].status == "finished", (tmp_path / "processes.log").read_text()[-4000:]
        assert runs[0].engine == "deployment"
        done = [r for r in rounds if r.round > 0]
        assert len(done) == 2
        assert all(r.num_clients == 2 and r.bytes_up > 4 * 4810 * 2 for r in done)
        assert done[-1].test_accuracy > 0.5
        # federated evaluation on the SuperNodes: both nodes' validation splits make up the test set,
        # so the example-weighted federated accuracy is the server's test accuracy
        assert all(r.fed_examples == 359 for r in done)  # digits: the 359 held-out examples
        assert done[-1].fed_accuracy == pytest.approx(done[-1].test_accuracy, abs=1e-6)
        assert all(r.metrics["eval_bytes_up"] > 0 and r.metrics["bytes_telemetry"] > 0 for r in done)
        # each SuperNode reported its class and its probed device
        nodes = [n for n in store.list_nodes() if n.kind == "supernode"]
        assert len(nodes) == 2 and {n.device_class for n in nodes} == {"cpu"}
        assert all(n.info.get("device") == "cpu" and n.info.get("step_ms", 0) > 0 for n in nodes)
    finally:
        _stop(procs)
        log.close()
