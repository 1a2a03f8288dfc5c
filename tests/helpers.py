"""Helpers every test module may use: free loopback ports, and waiting on a condition with a
deadline (never a bare sleep and a hope)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Callable, TypeVar

T = TypeVar("T")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(pred: Callable[[], T], timeout: float = 60.0, *, interval: float = 0.05, what: str = "") -> T:
    """Poll ``pred`` until it returns something truthy, and return that; fail the test with
    ``what`` if ``timeout`` seconds pass first. The poll interval only bounds latency: the
    outcome never depends on it, so a loaded machine makes the test slower, not flaky."""
    end = time.monotonic() + timeout
    pause = threading.Event()
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() >= end:
            raise AssertionError(f"{what or 'condition'} not met within {timeout} s")
        pause.wait(interval)


def port_open(host: str, port: int) -> bool:
    """True once something accepts TCP connections on ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def runs_ended(db) -> list | None:
    """The runs in the store at ``db`` once its newest run has finished or failed, else None
    (no store file yet, or still running): a condition for :func:`wait_until`."""
    from fedswarm.store import Store

    if not db.exists():
        return None
    store = Store(db)
    try:
        runs = store.list_runs()
        return runs if runs and runs[0].status in ("finished", "failed") else None
    finally:
        store.close()


def record_run(cfg, db, name: str | None = None) -> tuple[str, dict, list]:
    """Run ``cfg`` (a RunConfig) on its engine into the store at ``db`` and check it finished:
    (run id, :meth:`Store.export_result`, the run's per-node rows)."""
    from fedswarm.sim.run import run_engine
    from fedswarm.store import Store

    store = Store(db)
    try:
        rid = store.create_run(cfg.model_dump(), name=name)
        assert run_engine(cfg, store=store, run_id=rid) == "finished"
        return rid, store.export_result(rid), store.node_rounds(rid)
    finally:
        store.close()
