"""Serialized answers of the busiest read routes (``/api/runs``, a run, its rounds), shared by
every client that asks the same question while the store has not changed.

An entry is fresh while the store's *change mark* is what it was when the entry was built, and
for at most ``ttl_s`` (liveness, "lost", depends on time, not only on writes). The mark is one
cheap query (the highest id of rounds, events, controls and per-node rows: every round, status
change, control and new run writes one of them, whichever process writes) made at most every
``mark_s``. So with many viewers the store answers a few queries a second, not one per request.

Stale-while-revalidate: an entry that is no longer known to be fresh (its mark is older than
``mark_s``, or the store changed, or ``ttl_s`` passed) but was built less than ``max_stale_s``
ago is still served while one background thread re-checks the mark and, if needed, rebuilds it
(:meth:`lookup` + :meth:`refresh_soon`). So an answer is at most ``max_stale_s`` old, and the
event loop never waits on the store for a cached question. An entry in the last ``ahead_s`` of
its ``ttl_s`` (a third of it by default) is still fresh but is rebuilt in the background too, so a
busy entry is replaced before it expires: with the rebuild begun only at expiry, every request
of the rebuild's duration (~0.1 s each ``ttl_s`` under load) found an entry too old to serve
(``max_stale_s`` = ``ttl_s``) and took the route's slow path, the tail of ``/api/runs``. With
the defaults (``ttl_s`` 1.5 s, rebuilt from 1 s of age) a busy entry is rebuilt once a second,
as when ``ttl_s`` was 1 s and the rebuild began at expiry; an unchanged store's answer is then
at most 1.5 s old (a change to the store is seen within ``mark_s`` plus a rebuild, as before).
``clear()`` (after this process's own writes) drops every entry, so an actor sees its change on
the next read.

:meth:`alias` records which raw request (path and query string) a validated route answered
with which entry, so that :class:`fedswarm.web.hot_reads.CachedReads` can answer the same raw
request again without the framework's routing and parameter validation.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from sqlalchemy import text

from fedswarm.store import Store

__all__ = ["ResponseCache", "Answer", "breathe"]

log = logging.getLogger(__name__)

_MARK_SQL = text("SELECT (SELECT max(id) FROM rounds), (SELECT max(id) FROM events), "
                 "(SELECT max(id) FROM controls), (SELECT max(id) FROM node_rounds)")


def breathe() -> None:
    """Let the event loop run: a background thread calls this between steps of its work. A real
    sleep, not ``sleep(0)``: on a server pinned to one core, a thread that only drops the GIL
    takes it back before the woken event-loop thread is scheduled."""
    time.sleep(0.0005)


@dataclass(frozen=True)
class Answer:
    """A ready JSON answer: its body and any extra headers (e.g. ``X-Total-Count``). ``ready``
    keeps what the dashboard's middleware built from it once (its ASGI messages), so that lives
    and goes with the answer; not part of its value."""

    body: bytes
    headers: tuple[tuple[str, str], ...] = field(default=())
    ready: dict = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class _Entry:
    expires: float
    mark: tuple
    built_at: float
    value: object
    build: Callable[[], object]


class ResponseCache:
    def __init__(self, store: Store, ttl_s: float = 1.5, mark_s: float = 0.25, max_entries: int = 512,
                 max_stale_s: float = 1.5, ahead_s: float | None = None):
        self.store = store
        self.ttl_s = ttl_s
        self.ahead_s = ttl_s / 3 if ahead_s is None else ahead_s
        self.mark_s = mark_s
        self.max_entries = max_entries
        self.max_stale_s = max_stale_s
        self._entries: dict[tuple, _Entry] = {}
        self._aliases: dict[tuple[str, bytes], tuple] = {}
        self._mark: tuple = ()
        self._mark_at = 0.0
        self._lock = threading.Lock()
        self._building: dict[tuple, threading.Lock] = {}
        self._refreshing: set[tuple] = set()  # touched on the event loop only
        self._generation = 0  # bumped by clear(): a build begun before it is not kept
        self.hits = self.misses = self.stale = 0

    def mark(self) -> tuple:
        now = time.monotonic()
        if now - self._mark_at > self.mark_s:
            with self.store.engine.connect() as conn:
                self._mark = tuple(conn.execute(_MARK_SQL).one())
            self._mark_at = now
        return self._mark

    def lookup(self, key: tuple) -> tuple[object | None, bool]:
        """(answer, needs_refresh) without touching the store (safe on the event loop).

        A fresh entry gives (answer, False), or (answer, True) in its last ``ahead_s``: serve
        it and call :meth:`refresh_soon`; one that may be out of date but was built less than
        ``max_stale_s`` ago gives (answer, True): serve it and call :meth:`refresh_soon`;
        otherwise (None, True): build it with :meth:`get` in a thread."""
        entry = self._entries.get(key)
        if entry is None:
            return None, True
        now = time.monotonic()
        if now - self._mark_at <= self.mark_s and entry.expires > now and entry.mark == self._mark:
            self.hits += 1
            return entry.value, entry.expires - now < self.ahead_s
        if now - entry.built_at <= self.max_stale_s:
            self.stale += 1
            return entry.value, True
        return None, True

    def refresh_soon(self, key: tuple) -> asyncio.Future | None:
        """Re-check (and if needed rebuild) ``key`` in a worker thread, once at a time; call on
        the event loop. Returns the rebuild's future, or None when one is already running."""
        entry = self._entries.get(key)
        if entry is None or key in self._refreshing:
            return None
        self._refreshing.add(key)
        fut = asyncio.get_running_loop().run_in_executor(None, self._refresh, key, entry.build)
        fut.add_done_callback(lambda _: self._refreshing.discard(key))
        return fut

    def _refresh(self, key: tuple, build: Callable[[], object]) -> None:
        try:
            self.get(key, build, margin=self.ahead_s)
        except Exception as exc:  # e.g. the run is gone: forget the answer, the route will say why
            log.debug("cache refresh of %s failed: %s", key, exc)
            with self._lock:
                self._entries.pop(key, None)

    def get(self, key: tuple, build: Callable[[], object], margin: float = 0.0) -> object:
        """The cached answer for ``key``, or ``build()`` once (concurrent askers wait for it);
        ``margin``: an entry expiring within it is rebuilt (a refresh ahead of expiry)."""
        generation = self._generation
        mark = self.mark()
        hit = self._fresh(key, mark, margin)
        if hit is not None:
            self.hits += 1
            return hit
        with self._lock:
            lock = self._building.setdefault(key, threading.Lock())
        if not lock.acquire(blocking=False):
            stale = self._entries.get(key)
            if stale is not None:  # another thread is rebuilding it: the last answer, now
                self.stale += 1
                return stale.value
            lock.acquire()
        try:
            hit = self._fresh(key, mark, margin)
            if hit is not None:
                self.hits += 1
                return hit
            self.misses += 1
            value = build()
            now = time.monotonic()
            with self._lock:
                if generation == self._generation:  # no write of this process since we began
                    if len(self._entries) >= self.max_entries:
                        self._entries.clear()
                    self._entries[key] = _Entry(now + self.ttl_s, mark, now, value, build)
            return value
        finally:
            lock.release()

    def _fresh(self, key: tuple, mark: tuple, margin: float = 0.0) -> object | None:
        entry = self._entries.get(key)
        if entry is not None and entry.expires - margin > time.monotonic() and entry.mark == mark:
            return entry.value
        return None

    def alias(self, path: str, query: bytes, key: tuple) -> None:
        """Remember that the validated request ``path?query`` is answered by entry ``key``."""
        raw = (path, query)
        if self._aliases.get(raw) != key:
            with self._lock:
                if len(self._aliases) >= 4 * self.max_entries:
                    self._aliases.clear()
                self._aliases[raw] = key

    def key_for(self, path: str, query: bytes) -> tuple | None:
        """The entry key a validated route gave for this raw request, if any."""
        return self._aliases.get((path, query))

    def clear(self) -> None:
        """Forget every answer (this process just wrote something a reader must see at once)."""
        with self._lock:
            self._generation += 1
            self._entries.clear()
            self._mark_at = 0.0
