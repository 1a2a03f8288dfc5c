"""A secure Flower deployment on loopback, driven by what ``fedswarm certs`` makes: a real
SuperLink with TLS and SuperNode authentication, two registered SuperNodes running
fedswarm's App, a third SuperNode with an unregistered key refused, a plaintext one refused.
The README's "Deploy on real devices" section lists the same commands."""

from __future__ import annotations

import http.client
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fedswarm.procs import stop_process_groups
from fedswarm.store import Store

from tests.helpers import runs_ended, free_port, port_open, wait_until

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # flwr's commands sit beside this interpreter
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]  # a loaded 2-core machine: minutes


def test_tls_supernode_auth_two_registered_nodes_run_and_intruders_are_refused(tmp_path):
    env = dict(os.environ, FLWR_HOME=str(tmp_path / "flwr"), PYTHONUNBUFFERED="1",
               FLWR_SUPEREXEC_TASK_POLL_INTERVAL="0.25",
               PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    pki, port, db = tmp_path / "pki", free_port(), tmp_path / "store.db"

    def run(cmd: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)

    made = run([str(BIN / "fedswarm"), "certs", "init", "--out", str(pki), "--host", "localhost", "--host",
                "127.0.0.1", "--supernodes", "3"])
    assert made.returncode == 0, made.stdout + made.stderr
    (tmp_path / "flwr").mkdir()
    (tmp_path / "flwr" / "config.toml").write_text(
        f'[superlink]\ndefault = "secure"\n\n[superlink.secure]\naddress = "127.0.0.1:{port}"\n'
        f'root-certificates = "{pki / "ca.pem"}"\n')
    procs: dict[str, subprocess.Popen] = {}
    logs: dict[str, Path] = {}

    def spawn(name: str, cmd: list[str]) -> None:
        logs[name] = tmp_path / f"{name}.log"
        with open(logs[name], "w") as f:
            procs[name] = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def client(name: str, partition: int, *extra: str) -> None:
        spawn(name, [sys.executable, "-m", "fedswarm", "client", "--superlink", f"127.0.0.1:{port}",
                     "--partition-id", str(partition), "--num-partitions", "2", "--device-class", "cpu",
                     "--clientappio-port", str(free_port()), "--state-dir", str(tmp_path / f"{name}-state"), *extra])

    def tail(name: str) -> str:
        return logs[name].read_text()[-3000:] if logs[name].exists() else ""

    try:
        spawn("superlink", [str(BIN / "flower-superlink"), "--ssl-ca-certfile", str(pki / "ca.pem"),
                            "--ssl-certfile", str(pki / "superlink" / "server.pem"),
                            "--ssl-keyfile", str(pki / "superlink" / "server.key"), "--enable-supernode-auth",
                            "--host", "127.0.0.1", "--port", str(port), "--database", str(tmp_path / "state.db"),
                            "--disable-runtime-dependency-installation"])
        wait_until(lambda: port_open("127.0.0.1", port), 60, interval=0.2, what="the SuperLink listening")
        for i in (0, 1):  # the operator registers the two nodes' public keys
            reg = run([str(BIN / "flwr"), "supernode", "register", str(pki / "supernodes" / f"sn{i}.pub"), "secure"])
            assert reg.returncode == 0 and "registered" in reg.stdout, reg.stdout + reg.stderr
        for i in (0, 1):
            client(f"sn{i}", i, "--root-certificates", str(pki / "ca.pem"),
                   "--auth-key", str(pki / "supernodes" / f"sn{i}.key"))
        client("unregistered", 1, "--root-certificates", str(pki / "ca.pem"),
               "--auth-key", str(pki / "supernodes" / "sn2.key"), "--rejoin-wait", "0")
        client("plaintext", 1, "--insecure")

        # the unregistered key: the SuperLink refuses to activate it and the SuperNode gives up
        wait_until(lambda: procs["unregistered"].poll() is not None, 180, interval=0.2,
                   what="the unregistered SuperNode being refused")
        assert procs["unregistered"].returncode != 0
        assert "Failed to activate SuperNode" in tail("unregistered"), tail("unregistered")
        assert "No SuperNode found with the given public key" in tail("superlink")
        # plaintext: no connection ever succeeds (the SuperNode keeps retrying), and a plain
        # HTTP request gets no HTTP answer from the TLS port
        wait_until(lambda: tail("plaintext").count("Connection attempt failed") >= 2, 120, interval=0.2,
                   what="the plaintext SuperNode's connection attempts failing")
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        with pytest.raises((http.client.HTTPException, OSError)):
            conn.request("POST", "/v1/fleet/activate-node", body=b"{}")
            conn.getresponse()
        conn.close()

        started = run([str(BIN / "flwr"), "run", str(ROOT), "secure", "--run-config",
                       f"rounds=2 clients=2 db='{db}'"])
        assert started.returncode == 0, started.stdout + started.stderr

        def ended():
            return runs_ended(db)

        try:
            runs = wait_until(ended, 300, interval=0.5, what="the run finishing")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{tail('superlink')}\n{tail('sn0')}") from None
        store = Store(db)
        try:
            assert runs[0].status == "finished", tail("superlink")
            done = [r for r in store.rounds(runs[0].id) if r.round > 0]
            assert len(done) == 2 and all(r.num_clients == 2 for r in done)
            nodes = [n for n in store.list_nodes() if n.kind == "supernode"]
            assert len(nodes) == 2  # only the two registered nodes ever trained
        finally:
            store.close()
        assert procs["plaintext"].poll() is None and "SuperNode ID" not in tail("plaintext")
    finally:
        stop_process_groups(list(procs.values()))
