"""Processes fedswarm starts and watches: whether one still runs here and which process it is
(the checks behind a run's liveness, :mod:`fedswarm.store.liveness`), and stopping the process
groups a benchmark or a test started (SuperLinks, SuperNodes, peers)."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

__all__ = ["pid_alive", "process_start", "stop_process_groups"]


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


def process_start(pid: int) -> str | None:
    """When process ``pid`` started, as ``BOOT_ID:TICKS`` (the kernel's boot and the start in
    clock ticks since it): with the pid it names one process, so a pid the kernel gave to a
    later process is not taken for the first. None where ``/proc`` cannot say (not Linux, gone)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()  # after the command name, which may hold spaces
    return f"{boot}:{fields[19]}"  # field 22 of proc(5), starttime


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
