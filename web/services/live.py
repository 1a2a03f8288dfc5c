"""Live updates: one shared poller on the store fans new rounds and status changes out to
every server-sent-event stream.

The poller asks the store for rounds with an id above the last one seen (an indexed
primary-key range) every ``interval_s`` (0.3 s by default), so a viewer hears of a round
well within a second of it being written, and 100 viewers cost one query, not 100.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, AsyncIterator

from sqlalchemy import func, select

from fedswarm.store import Round, Run, Store
from fedswarm.web import models
from fedswarm.web.services import queries
from fedswarm.web.services.run_state import display_status

__all__ = ["Hub", "sse", "status_event"]

log = logging.getLogger(__name__)
QUEUE_SIZE = 2000
KEEPALIVE_S = 15.0


def sse(kind: str, data: Any, event_id: int | None = None) -> str:
    head = f"event: {kind}\n" + (f"id: {event_id}\n" if event_id is not None else "")
    return head + f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


class Hub:
    def __init__(self, store: Store, interval_s: float = 0.3, timeout_s: float = 120.0,
                 can_restart: Any = lambda run: False):
        self.store = store
        self.interval_s = interval_s
        self.timeout_s = timeout_s  # a silent remote run shows as lost after this
        self.can_restart = can_restart
        self._subs: dict[str | None, set[asyncio.Queue]] = {}
        self._last_round_id = 0
        self._status: dict[str, tuple[str, int, str | None]] = {}
        self._task: asyncio.Task | None = None

    # -- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        self._last_round_id = await asyncio.to_thread(self._max_round_id)
        self._task = asyncio.create_task(self._loop(), name="fedswarm-live-hub")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        for queues in self._subs.values():
            for q in queues:
                q.put_nowait(None)

    def subscribe(self, run_id: str | None) -> asyncio.Queue:
        """A queue of (kind, data) for one run, or for every run when run_id is None."""
        q: asyncio.Queue = asyncio.Queue(QUEUE_SIZE)
        self._subs.setdefault(run_id, set()).add(q)
        return q

    def unsubscribe(self, run_id: str | None, q: asyncio.Queue) -> None:
        subs = self._subs.get(run_id)
        if subs is not None:
            subs.discard(q)
            if not subs:
                self._subs.pop(run_id, None)

    @property
    def viewers(self) -> int:
        return sum(len(s) for s in self._subs.values())

    # -- polling -----------------------------------------------------------------------
    def _max_round_id(self) -> int:
        with self.store.session() as s:
            return int(s.scalar(select(func.max(Round.id))) or 0)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                if not self._subs:  # nobody watching: just keep up with the newest round id
                    self._last_round_id = await asyncio.to_thread(self._max_round_id)
                    continue
                events = await asyncio.to_thread(self._poll, set(self._subs))
            except Exception:  # a store hiccup must not end live updates for everyone
                log.exception("live-update poll failed")
                continue
            for run_id, kind, data in events:
                for key in (run_id, None):
                    for q in list(self._subs.get(key, ())):
                        try:
                            q.put_nowait((kind, data))
                        except asyncio.QueueFull:  # a stalled viewer: drop it; it reconnects
                            self.unsubscribe(key, q)
                            q.get_nowait()
                            q.put_nowait(None)

    def _poll(self, keys: set[str | None]) -> list[tuple[str, str, Any]]:
        events: list[tuple[str, str, Any]] = []
        watch_all = None in keys
        with self.store.session() as s:
            rows = list(s.scalars(select(Round).where(Round.id > self._last_round_id)
                                  .order_by(Round.id).limit(5000)))
            q = select(Run)
            if not watch_all:
                q = q.where(Run.id.in_([k for k in keys if k is not None]))
            else:
                q = q.order_by(Run.created_at.desc()).limit(200)
            runs = list(s.scalars(q))
        changed: set[str] = set()
        for r in rows:
            self._last_round_id = max(self._last_round_id, r.id)
            if r.run_id in keys or watch_all:
                data = models.RoundOut.model_validate(r).model_dump(mode="json")
                data["run_id"] = r.run_id
                events.append((r.run_id, "round", data))
                changed.add(r.run_id)
        watched = [r.id for r in runs if r.id in keys]
        stats = queries.stats_for(self.store, watched) if watched else {}
        for run in runs:
            if run.id in keys:  # a run page: everything its buttons and banners need
                data = status_event(run, stats.get(run.id, {}), self.timeout_s, self.can_restart(run))
                state = json.dumps(data, sort_keys=True, default=str)
            else:
                shown = display_status(run, self.timeout_s)
                state = json.dumps([shown, run.total_rounds, run.error])
                data = {"run_id": run.id, "status": run.status, "display_status": shown,
                        "total_rounds": run.total_rounds, "error": run.error}
            if self._status.get(run.id) != state:
                self._status[run.id] = state
                events.append((run.id, "status", data))
                changed.add(run.id)
        if watch_all and changed:
            stats = queries.stats_for(self.store, sorted(changed))
            for run in runs:
                if run.id in changed:
                    summary = queries.summary_of(run, stats.get(run.id, {}), self.timeout_s)
                    events.append((run.id, "run", summary.model_dump(mode="json")))
        return events


def status_event(run: Run, stats: dict, timeout_s: float, can_restart: bool) -> dict:
    """A run page's ``status`` event: shown status, why it is lost, progress in round
    numbers, pending controls, and which actions are valid now."""
    out = queries.summary_of(run, stats, timeout_s, can_restart)
    return {"run_id": run.id, "status": run.status, "display_status": out.display_status,
            "total_rounds": run.total_rounds, "last_round": out.last_round, "error": run.error,
            "lost_reason": out.lost_reason, "lost_after_s": out.lost_after_s, "pending": out.pending,
            "actions": out.actions, "failed_node_rounds": out.failed_node_rounds, "node_rounds": out.node_rounds,
            "bad_rounds": out.bad_rounds, "rounds_with_nodes": out.rounds_with_nodes}


async def stream(hub: Hub, store: Store, run_id: str | None, since: int,
                 is_disconnected: Any) -> AsyncIterator[str]:
    """The SSE body for one viewer: catch-up rounds after ``since``, then live events."""
    q = hub.subscribe(run_id)
    try:
        yield "retry: 2000\n\n"
        if run_id is not None:
            for r in await asyncio.to_thread(queries.rounds, store, run_id, since):
                data = r.model_dump(mode="json") | {"run_id": run_id}
                yield sse("round", data, r.round)
                since = r.round
            run = await asyncio.to_thread(store.get_run, run_id)
            if run is not None:
                stats = await asyncio.to_thread(queries.stats_for, store, [run_id])
                yield sse("status", status_event(run, stats.get(run_id, {}), hub.timeout_s, hub.can_restart(run)))
        while True:
            try:
                item = await asyncio.wait_for(q.get(), KEEPALIVE_S)
            except asyncio.TimeoutError:
                if await is_disconnected():
                    return
                yield ": keepalive\n\n"
                continue
            if item is None:
                return
            kind, data = item
            if kind == "round" and run_id is not None:
                if data["round"] <= since:
                    continue
                since = data["round"]
                yield sse(kind, data, data["round"])
            else:
                yield sse(kind, data)
    finally:
        hub.unsubscribe(run_id, q)
