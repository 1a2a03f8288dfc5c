"""A real Ray cluster on loopback for the tests: ``ray start --head`` and, with ``nodes > 1``,
more ``ray start --address`` nodes joining it, every process in sessions of our own (killed
as groups at the end, so no other user's Ray processes are touched, as ``ray stop`` would)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import free_port, port_open, wait_until

RAY = shutil.which("ray", path=str(Path(sys.executable).parent)) or shutil.which("ray")


@contextlib.contextmanager
def ray_cluster(nodes: int = 1, cpus: int = 2) -> Iterator[tuple[str, str]]:
    """Yield ``(address, temp_dir)`` of a cluster of ``nodes`` nodes of ``cpus`` CPUs each;
    stop it on the way out (no process of it outlives the block)."""
    if RAY is None:
        pytest.fail("the 'ray' command is missing: install fedswarm with the 'sim' extra")
    port = free_port()
    temp_dir = tempfile.mkdtemp(prefix="fsray", dir="/tmp")  # short: Ray's socket paths have a length limit
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    common = ["--block", "--node-ip-address", "127.0.0.1", "--num-cpus", str(cpus), "--disable-usage-stats",
              "--object-store-memory", str(100 * 2**20)]
    procs: list[subprocess.Popen] = []

    def start(args: list[str]) -> subprocess.Popen:
        proc = subprocess.Popen([RAY, "start", *args, *common], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=env, start_new_session=True)
        procs.append(proc)
        return proc

    try:
        head = start(["--head", "--port", str(port), "--include-dashboard", "false", "--temp-dir", temp_dir])
        wait_until(lambda: port_open("127.0.0.1", port) or head.poll() is not None, timeout=180,
                   what="Ray's GCS to listen")
        if head.poll() is not None:
            pytest.fail(f"ray start --head exited: {head.stdout.read()[-3000:]}")
        address = f"127.0.0.1:{port}"
        for _ in range(nodes - 1):
            start(["--address", address])
        if nodes > 1:
            wait_until(lambda: _alive_nodes(temp_dir) >= nodes or any(p.poll() is not None for p in procs),
                       timeout=180, what=f"{nodes} Ray nodes to register")
            dead = [p for p in procs if p.poll() is not None]
            if dead:
                pytest.fail(f"a Ray node exited: {dead[0].stdout.read()[-3000:]}")
        yield address, temp_dir
    finally:
        _stop(procs)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _alive_nodes(temp_dir: str) -> int:
    """The nodes the cluster's GCS registered (its log says so of each)."""
    log = Path(temp_dir) / "session_latest" / "logs" / "gcs_server.out"
    try:
        return log.read_text(errors="replace").count("Registering new node")
    except FileNotFoundError:
        return 0


def _stop(procs: list[subprocess.Popen]) -> None:
    """Stop every node: SIGTERM to all their sessions at once, SIGKILL to what still runs after 15 s."""
    for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 30)):
        live = [p for p in procs if session_alive(p.pid)]
        for p in live:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, sig)
        try:
            wait_until(lambda live=live: not any(session_alive(p.pid) for p in live), timeout=grace,
                       what="Ray to stop")
            break
        except AssertionError:
            if sig == signal.SIGKILL:
                raise
    for p in procs:
        p.wait(timeout=30)  # reaped


def session_alive(sid: int) -> bool:
    """Whether a live (not zombie) process of session ``sid`` remains."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if os.getsid(int(pid)) == sid:
                stat = Path(f"/proc/{pid}/stat").read_text()
                if stat.rsplit(")", 1)[1].split()[0] != "Z":
                    return True
        except (ProcessLookupError, FileNotFoundError, PermissionError):
            continue
    return False
