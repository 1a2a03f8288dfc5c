"""A Ray cluster of our own on this machine, for the benchmarks and the tests: ``ray start
--head`` on a free loopback port and, with ``nodes > 1``, more ``ray start --address`` nodes
joining it. Every node runs in a session of its own, stopped as a group at the end (no other
user's Ray processes are touched, as ``ray stop`` would), in a temporary folder of its own."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from fedswarm.procs import processes

__all__ = ["RAY", "local_ray_cluster", "session_alive"]

RAY = shutil.which("ray", path=str(Path(sys.executable).parent)) or shutil.which("ray")


def _poll(pred: Callable[[], object], timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    pause = threading.Event()
    while not pred():
        if time.monotonic() >= end:
            raise TimeoutError(f"{what} not within {timeout:.0f} s")
        pause.wait(0.05)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


@contextlib.contextmanager
def local_ray_cluster(nodes: int = 1, cpus: int = 2, start_timeout: float = 180.0) -> Iterator[tuple[str, str]]:
    """Yield ``(address, temp_dir)`` of a cluster of ``nodes`` nodes of ``cpus`` CPUs each, every
    node registered; stop it on the way out (no process of it outlives the block). Raises
    :class:`RuntimeError` when the ``ray`` command is missing or a node exits while starting."""
    if RAY is None:
        raise RuntimeError("the 'ray' command is missing: install fedswarm with the 'sim' extra")
    port = _free_port()
    temp_dir = tempfile.mkdtemp(prefix="fsray", dir="/tmp")  # short: Ray's socket paths have a length limit
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    common = ["--block", "--node-ip-address", "127.0.0.1", "--num-cpus", str(cpus), "--disable-usage-stats",
              "--object-store-memory", str(100 * 2**20)]
    procs: list[subprocess.Popen] = []

    def start(args: list[str]) -> None:
        procs.append(subprocess.Popen([RAY, "start", *args, *common], stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True))

    def exited() -> subprocess.Popen | None:
        return next((p for p in procs if p.poll() is not None), None)

    try:
        start(["--head", "--port", str(port), "--include-dashboard", "false", "--temp-dir", temp_dir])
        _poll(lambda: _listening(port) or exited(), start_timeout, "Ray's GCS to listen")
        address = f"127.0.0.1:{port}"
        for _ in range(nodes - 1):
            start(["--address", address])
        _poll(lambda: registered_nodes(temp_dir) >= nodes or exited(), start_timeout,
              f"{nodes} Ray nodes to register")
        dead = exited()
        if dead is not None:
            raise RuntimeError(f"a Ray node exited while starting: {dead.stdout.read()[-3000:]}")
        yield address, temp_dir
    finally:
        _stop(procs)
        shutil.rmtree(temp_dir, ignore_errors=True)


def registered_nodes(temp_dir: str) -> int:
    """The nodes the cluster's GCS registered (its log says so of each)."""
    log = Path(temp_dir) / "session_latest" / "logs" / "gcs_server.out"
    try:
        return log.read_text(errors="replace").count("Registering new node")
    except FileNotFoundError:
        return 0


def _stop(procs: list[subprocess.Popen]) -> None:
    """Stop every node: SIGTERM to all their sessions at once, SIGKILL to what still runs after 15 s."""
    for sig, grace in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 30.0)):
        live = [p for p in procs if session_alive(p.pid)]
        for p in live:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, sig)
        try:
            _poll(lambda live=live: not any(session_alive(p.pid) for p in live), grace, "Ray to stop")
            break
        except TimeoutError:
            if sig == signal.SIGKILL:
                raise
    for p in procs:
        p.wait(timeout=30)  # reaped


def session_alive(sid: int) -> bool:
    """Whether a live (not zombie) process of session ``sid`` remains."""
    for pid, fields in processes():
        try:
            if fields[0] != "Z" and os.getsid(pid) == sid:
                return True
        except (ProcessLookupError, PermissionError):
            continue
    return False
