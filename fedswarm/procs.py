"""Processes fedswarm starts and watches: whether one still runs here (the one check the
dashboard's run liveness and ``fedswarm resume`` share), and stopping the process groups a
benchmark or a test started (SuperLinks, SuperNodes, peers)."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

__all__ = ["pid_alive", "stop_process_groups"]


def pid_alive(pid: int | None) -> bool:
    """True while the process lives; reaps it first if it is our own exited child."""
    if not pid or pid <= 0:
        return False
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    except ChildProcessError:
        pass  # not our child (started by an earlier dashboard): ask the kernel instead
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return not _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] == "Z"


def stop_process_groups(procs: list[subprocess.Popen], grace_s: float = 15.0) -> None:
    """SIGTERM the process group of each of ``procs`` (started with ``start_new_session=True``)
    that still runs, wait up to ``grace_s`` for each, and SIGKILL the groups that stay."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
