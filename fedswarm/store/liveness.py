"""Whether a run the store calls live still has something behind it: the one rule that
``fedswarm runs``, ``fedswarm resume`` and the dashboard apply.

The store's status is what the run's process last wrote; a process killed with SIGKILL (or a
machine that lost power) writes nothing, so its run would stay ``running`` for ever. A run
therefore records its process when it starts (:func:`owner_fields`: pid, host, and when the
process started, so a pid the kernel hands to a later process does not pass for the run's),
and a live run is ``lost`` when that process is gone. A run registered through ingest (a
swarm, a remote ServerApp) has no local process: it is lost when it has reported nothing for
longer than its timeout. A run whose process lives on another host (a store shared by several
machines) cannot have its pid checked from here: its process writes a heartbeat
(:class:`Heartbeat`, ``last_report_at`` every :data:`HEARTBEAT_S`), and the run is lost when the
heartbeat is older than the run's timeout; a run from a fedswarm without heartbeats is taken as live.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import socket
import threading
from typing import Any

from fedswarm.procs import pid_alive, process_start
from fedswarm.store.schema import Run, _now  # the store's naive-UTC clock

__all__ = ["HEARTBEAT_S", "LIVE_STATUSES", "REPORT_TIMEOUT_S", "Heartbeat", "owner_fields", "owner_gone", "lost_reason",
           "live_status", "is_remote", "timeout_of"]

log = logging.getLogger(__name__)

LIVE_STATUSES = ("pending", "running", "paused")

#: A run registered through ingest that reports nothing for this long is lost (the dashboard's
#: ``report_timeout_s`` default; a reporter may ask for another when it registers the run).
REPORT_TIMEOUT_S = 120.0

#: How often a run's process writes its heartbeat (``FEDSWARM_HEARTBEAT_S`` sets another): well
#: under :data:`REPORT_TIMEOUT_S`, so a few missed beats, not one, make a run on another host lost.
HEARTBEAT_S = 30.0


def owner_fields(pid: int | None = None) -> dict[str, Any]:
    """The :class:`Run` columns that name process ``pid`` (default: this one) on this host as
    the run's owner."""
    pid = os.getpid() if pid is None else pid
    return {"pid": pid, "host": socket.gethostname(), "pid_start": process_start(pid)}


def _silent(last: dt.datetime | None, timeout: float, now: dt.datetime | None, what: str) -> str | None:
    """``what`` and since when, if ``last`` is more than ``timeout`` seconds before ``now``."""
    if last is None or ((now or _now()) - last).total_seconds() <= timeout:
        return None
    return f"{what} for over {timeout:.0f} s (last at {last:%Y-%m-%d %H:%M:%S} UTC)"


def owner_gone(run: Run, default_timeout_s: float = REPORT_TIMEOUT_S, now: dt.datetime | None = None) -> str | None:
    """Why the process that owns ``run`` is gone, or None when it runs, or when this machine
    cannot tell (no process recorded; one on another host that writes no heartbeat)."""
    if not run.pid:
        return None
    if run.host and run.host != socket.gethostname():
        return _silent(run.last_report_at, timeout_of(run, default_timeout_s), now,
                       f"its process {run.pid} on {run.host} has written no heartbeat")
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
        return owner_gone(run, default_timeout_s, now)
    if is_remote(run):
        return _silent(run.last_report_at or run.created_at, timeout_of(run, default_timeout_s), now, "no report")
    return None


def live_status(run: Run, default_timeout_s: float = REPORT_TIMEOUT_S) -> str:
    """The run's stored status, or ``lost`` when :func:`lost_reason` finds one."""
    return "lost" if lost_reason(run, default_timeout_s) is not None else run.status


class Heartbeat:
    """While a run's process runs it, write the run's ``last_report_at`` once at the start and
    then every ``every_s`` seconds (default :data:`HEARTBEAT_S`, or ``FEDSWARM_HEARTBEAT_S``):
    the sign of life by which a host that shares the store judges a run whose pid it cannot
    see. Use as a context manager; leaving it stops the beats. A failed write is logged and
    tried again at the next beat: a heartbeat never stops a run."""

    def __init__(self, store, run_id: str, every_s: float | None = None):
        if every_s is None:
            raw = os.environ.get("FEDSWARM_HEARTBEAT_S", str(HEARTBEAT_S))
            try:
                every_s = float(raw)
            except ValueError:
                raise ValueError(f"FEDSWARM_HEARTBEAT_S must be a number of seconds, got {raw!r}") from None
        if not 0 < every_s < float("inf"):
            raise ValueError(f"a heartbeat needs a positive, finite interval, got {every_s} s")
        self.store, self.run_id, self.every_s = store, run_id, every_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self) -> None:
        self.store.update_run(self.run_id, last_report_at=_now())

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.beat()
            except Exception as exc:  # noqa: BLE001 -- a store hiccup must not end the run; the next beat retries
                log.warning("heartbeat of run %s not written: %s", self.run_id, exc)

    def __enter__(self) -> Heartbeat:
        self.beat()
        self._thread = threading.Thread(target=self._loop, name=f"heartbeat-{self.run_id[:8]}", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
