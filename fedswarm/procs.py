"""Processes fedswarm starts and watches: whether one still runs here and which process it is
(the checks behind a run's liveness, :mod:`fedswarm.store.liveness`), and stopping the process
groups a benchmark or a test started (SuperLinks, SuperNodes, peers)."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

__all__ = ["pid_alive", "process_start", "processes", "stat_fields", "stop_process_groups"]


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
    except OSError:
        return None
    fields = stat_fields(pid)
    return f"{boot}:{fields[19]}" if fields is not None else None  # field 22 of proc(5), starttime


def stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name, which may hold spaces and
    parentheses: ``[state, ppid, ...]`` (proc(5)'s fields 3 on); None when the process is gone
    or ``/proc`` cannot say."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()


def processes() -> Iterator[tuple[int, list[str]]]:
    """``(pid, stat_fields(pid))`` of every process ``/proc`` lists now (none where there is no ``/proc``)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return
    for entry in entries:
        if entry.isdigit() and (fields := stat_fields(int(entry))) is not None:
            yield int(entry), fields


def _is_zombie(pid: int) -> bool:
    fields = stat_fields(pid)
    return fields is not None and fields[0] == "Z"


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
