"""Whether a process still runs here: the one check the dashboard (a run's liveness) and
``fedswarm resume`` (refusing a run whose process is alive) share."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["pid_alive"]


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
