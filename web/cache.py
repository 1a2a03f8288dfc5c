"""Serialized answers of the busiest read routes (``/api/runs``, a run's rounds), shared by
every client that asks the same question while the store has not changed.

An entry is valid while the store's *change mark* is what it was when the entry was built, and
for at most ``ttl_s`` (liveness, "lost", depends on time, not only on writes). The mark is one
cheap query (the highest id of rounds, events and controls: every round, status change, control
and new run writes one of them, whichever process writes) made at most every ``mark_s``. So
with many viewers the store answers a few queries a second, not one per request, and an answer
is never staler than ``max(mark_s, poll)`` plus one rebuild: while one thread rebuilds an
answer, others get the previous one instead of queueing behind it (stale-while-revalidate).
``clear()`` (after this process's own writes) drops everything, so an actor sees its change.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from sqlalchemy import text

from fedswarm.store import Store

__all__ = ["ResponseCache"]

_MARK_SQL = text("SELECT (SELECT max(id) FROM rounds), (SELECT max(id) FROM events), "
                 "(SELECT max(id) FROM controls), (SELECT max(id) FROM node_rounds)")


class ResponseCache:
    def __init__(self, store: Store, ttl_s: float = 1.0, mark_s: float = 0.25, max_entries: int = 512):
        self.store = store
        self.ttl_s = ttl_s
        self.mark_s = mark_s
        self.max_entries = max_entries
        self._entries: dict[tuple, tuple[float, tuple, object]] = {}
        self._mark: tuple = ()
        self._mark_at = 0.0
        self._lock = threading.Lock()
        self._building: dict[tuple, threading.Lock] = {}
        self.hits = self.misses = self.stale = 0

    def mark(self) -> tuple:
        now = time.monotonic()
        if now - self._mark_at > self.mark_s:
            with self.store.engine.connect() as conn:
                self._mark = tuple(conn.execute(_MARK_SQL).one())
            self._mark_at = now
        return self._mark

    def peek(self, key: tuple) -> object | None:
        """The cached answer if it is fresh and the change mark is recent, without touching the
        store (the event loop may call this; on None, call :meth:`get` in a thread)."""
        if time.monotonic() - self._mark_at > self.mark_s:
            return None
        hit = self._fresh(key, self._mark)
        if hit is not None:
            self.hits += 1
        return hit

    def get(self, key: tuple, build: Callable[[], object]) -> object:
        """The cached answer for ``key``, or ``build()`` once (concurrent askers wait for it)."""
        mark = self.mark()
        hit = self._fresh(key, mark)
        if hit is not None:
            self.hits += 1
            return hit
        with self._lock:
            lock = self._building.setdefault(key, threading.Lock())
        if not lock.acquire(blocking=False):
            stale = self._entries.get(key)
            if stale is not None:  # another thread is rebuilding it: the last answer, now
                self.stale += 1
                return stale[2]
            lock.acquire()
        try:
            hit = self._fresh(key, mark)
            if hit is not None:
                self.hits += 1
                return hit
            self.misses += 1
            body = build()
            with self._lock:
                if len(self._entries) >= self.max_entries:
                    self._entries.clear()
                self._entries[key] = (time.monotonic() + self.ttl_s, mark, body)
            return body
        finally:
            lock.release()

    def _fresh(self, key: tuple, mark: tuple) -> object | None:
        entry = self._entries.get(key)
        if entry is not None and entry[0] > time.monotonic() and entry[1] == mark:
            return entry[2]
        return None

    def clear(self) -> None:
        """Forget everything (this process just wrote something a reader must see at once)."""
        with self._lock:
            self._entries.clear()
            self._mark_at = 0.0
