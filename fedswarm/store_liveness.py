"""Whether a run the store calls live still has something behind it: the one rule that
``fedswarm runs``, ``fedswarm resume`` and the dashboard apply.

The store's status is what the run's process last wrote; a process killed with SIGKILL (or a
machine that lost power) writes nothing, so its run would stay ``running`` for ever. A run
therefore records its process when it starts (:func:`owner_fields`: pid, host, and when the
process started, so a pid the kernel hands to a later process does not pass for the run's),
and a live run is ``lost`` when that process is gone. A run registered through ingest (a
swarm, a remote ServerApp) has no local process: it is lost when it has reported nothing for
longer than its timeout. A run whose process lives on another host cannot be checked from
here and is taken as live.
"""

from __future__ import annotations

import datetime as dt
import os
import socket
from typing import Any

from fedswarm.procs import pid_alive, process_start
from fedswarm.store_schema import Run

__all__ = ["LIVE_STATUSES", "REPORT_TIMEOUT_S", "owner_fields", "owner_gone", "lost_reason", "live_status",
           "is_remote", "timeout_of"]

LIVE_STATUSES = ("pending", "running", "paused")

#: A run registered through ingest that reports nothing for this long is lost (the dashboard's
#: ``report_timeout_s`` default; a reporter may ask for another when it registers the run).
REPORT_TIMEOUT_S = 120.0


def owner_fields(pid: int | None = None) -> dict[str, Any]:
    """The :class:`Run` columns that name process ``pid`` (default: this one) on this host as
    the run's owner."""
    pid = os.getpid() if pid is None else pid
    return {"pid": pid, "host": socket.gethostname(), "pid_start": process_start(pid)}


def owner_gone(run: Run) -> str | None:
    """Why the process that owns ``run`` is gone, or None when it runs, or when this machine
    cannot tell (no process recorded, or one on another host)."""
    if not run.pid or (run.host and run.host != socket.gethostname()):
        return None
    if not pid_alive(run.pid):
        return f"its process {run.pid} is gone (killed, crashed, or exited early)"
    if run.pid_start and process_start(run.pid) not in (None, run.pid_start):
        return f"its process {run.pid} is gone (that pid now belongs to another process)"
    return None


def is_remote(run: Run) -> bool:
    """A run registered through ingest (a swarm, a remote ServerApp): it has no local process."""
    return bool(run.owner and run.owner.startswith("token:"))


def timeout_of(run: Run, default_s: float) -> float:
    return float(run.lost_after_s or default_s)


def lost_reason(run: Run, default_timeout_s: float = REPORT_TIMEOUT_S, now: dt.datetime | None = None) -> str | None:
    """Why a live run is lost, or None when it is not (or not live)."""
    if run.status not in LIVE_STATUSES:
        return None
    if run.pid:
        return owner_gone(run)
    if is_remote(run):
        last = run.last_report_at or run.created_at
        timeout = timeout_of(run, default_timeout_s)
        now = now or dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)
        if last is not None and (now - last).total_seconds() > timeout:
            return f"no report for over {timeout:.0f} s (last at {last:%Y-%m-%d %H:%M:%S} UTC)"
    return None


def live_status(run: Run, default_timeout_s: float = REPORT_TIMEOUT_S) -> str:
    """The run's stored status, or ``lost`` when :func:`lost_reason` finds one."""
    return "lost" if lost_reason(run, default_timeout_s) is not None else run.status
