"""Webhooks: signed JSON POSTs when a run finishes, fails, is lost or stopped, reaches its
privacy budget, or a node goes offline.

Runs are driven by other processes that only write the store, so the dashboard finds events
by reading it: a *watcher* thread checks the store every ``webhook_poll_s`` and queues a
delivery row (``webhook_deliveries``) for each new event and each enabled webhook that asked
for it and existed when it happened; a *sender* thread posts the due rows. Neither runs on a
request or in a run's process, so a slow receiver never holds anything up.

An event has a key that names it (``run:ID:finished:<finished_at>``, ``node:ID:offline:<last
seen>``, ...); a (webhook, key) pair is unique in the store, so an event is queued once per
webhook across restarts, and by one of several dashboards over the same store. A sender claims
a row before posting it (a conditional update), so two dashboards never post it at once.
Both threads step aside for the event loop between their store queries and posts
(:func:`fedswarm.web.cache.breathe`), so their Python work holds requests up for one step at a
time; neither ever runs a query on the event-loop thread.

Delivery is at least once: a dashboard killed between the receiver's answer and recording it
posts again after restarting; receivers deduplicate on ``X-Fedswarm-Delivery``.

Each POST's body is compact JSON with sorted keys, signed with HMAC-SHA256 under the
webhook's secret: ``X-Fedswarm-Signature: sha256=<hex>``. A non-2xx answer, a refused
connection or a timeout is retried after ``webhook_backoff_s``, doubling each time, up to
``webhook_attempts`` attempts; then the row is marked ``failed``. Every attempt's outcome is
kept on the row (shown on the admin page).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import json
import logging
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from sqlalchemy import func, not_, select, update
from sqlalchemy.exc import IntegrityError

import fedswarm
from fedswarm.store import Event, Node, Run, Store
from fedswarm.store.schema import Webhook, WebhookDelivery
from fedswarm.web.cache import breathe
from fedswarm.web.services.node_states import DOWN_STATUSES, FLEET_KINDS, online_clause
from fedswarm.web.services.fleet import ONLINE_WINDOW_S
from fedswarm.web.services.queries import stats_for
from fedswarm.web.services.run_state import LIVE_STATUSES, is_remote, lost_reason, shown_status, timeout_of
from fedswarm.web.secret_box import SecretBox, SecretUnavailable

__all__ = ["EVENTS", "Notice", "Webhooks", "sign", "check_url", "SIGNATURE_HEADER"]

log = logging.getLogger(__name__)
EVENTS = ("run.finished", "run.failed", "run.lost", "run.stopped", "run.privacy_budget", "node.offline")
SIGNATURE_HEADER = "X-Fedswarm-Signature"
SLACK_S = 120.0  # rescan this far behind the last scan: writers' clocks and commits lag a little
CLAIM_S = 120.0  # a claimed row is not posted by anyone else for this long


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)


def sign(secret: str, body: bytes) -> str:
    """The signature header's value for ``body``."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def body_of(payload: dict) -> bytes:
    return json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str).encode()


def check_url(url: str) -> str:
    """``url`` if it is an absolute http(s) URL with a host, else ValueError saying what is wrong."""
    url = url.strip()
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"a webhook URL must start with http:// or https:// (got '{parts.scheme or url[:20]}')")
    if not parts.hostname:
        raise ValueError("a webhook URL needs a host, e.g. https://hooks.example.com/fedswarm")
    if any(c.isspace() for c in url):
        raise ValueError("a webhook URL may not contain spaces")
    return url


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):  # a 3xx is the receiver's answer, not followed
        return None


@dataclass(frozen=True)
class Notice:
    """An event found in the store."""

    event: str
    key: str
    occurred_at: dt.datetime
    payload: dict
    run_id: str | None = None
    node_id: str | None = None


def _iso(t: dt.datetime | None) -> str | None:
    return t.isoformat() if t is not None else None


def _run_info(run: Run, shown: str, why_lost: str | None = None) -> dict:
    return {"id": run.id, "name": run.name, "status": run.status, "display_status": shown,
            "strategy": run.strategy, "task": run.task, "total_rounds": run.total_rounds, "error": run.error,
            "lost_reason": why_lost, "started_at": _iso(run.started_at), "finished_at": _iso(run.finished_at)}


def _payload(event: str, occurred: dt.datetime, message: str, **parts: Any) -> dict:
    return {"event": event, "occurred_at": _iso(occurred), "message": message, **parts}


class Webhooks:
    """The watcher and sender threads of one dashboard (started and stopped with its lifespan)."""

    def __init__(self, store: Store, settings: Any, box: SecretBox):
        self.store, self.settings, self.box = store, settings, box
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._threads: list[threading.Thread] = []
        self._since: dt.datetime | None = None  # time of the last scan
        self._event_cursor = 0  # events with a higher id are not yet read
        self._scan_lock = threading.Lock()
        # Direct connections (no proxy from the environment), redirects not followed.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        self._stop.clear()
        for name, target in (("watcher", self._watch), ("sender", self._send_loop)):
            t = threading.Thread(target=target, daemon=True, name=f"fedswarm-webhook-{name}")
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        for t in self._threads:
            t.join(self.settings.webhook_timeout_s + 2)
        self._threads = []

    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                if self.scan():
                    self._wake.set()
            except Exception:  # a store hiccup must not end the watcher
                log.exception("webhook watcher: scan failed")
            self._stop.wait(self.settings.webhook_poll_s)

    # -- finding events ----------------------------------------------------------------
    def scan(self) -> int:
        """Queue a delivery for every new event; returns how many were queued."""
        with self._scan_lock:
            return self._scan()

    def _scan(self) -> int:
        with self.store.session() as s:
            hooks = list(s.scalars(select(Webhook).where(Webhook.enabled.is_(True))))
        if not hooks:
            return 0
        now = _now()
        oldest = min(h.created_at for h in hooks)
        lower = oldest if self._since is None else max(oldest, self._since - dt.timedelta(seconds=SLACK_S))
        notices: list[Notice] = []
        for step in (lambda: self._ended_runs(lower), lambda: self._lost_runs(now), lambda: self._privacy(oldest),
                     lambda: self._offline(lower, now)):
            breathe()
            notices += step()
        self._since = now
        return self._enqueue(hooks, notices)

    def _ended_runs(self, lower: dt.datetime) -> list[Notice]:
        with self.store.session() as s:
            runs = list(s.scalars(select(Run).where(Run.status.in_(("finished", "failed", "stopped")),
                                                    Run.finished_at >= lower)))
            finished = [r.id for r in runs if r.status == "finished"]
            stats = stats_for(self.store, finished, s) if finished else {}
        out = []
        for run in runs:
            shown = shown_status(run, None, stats.get(run.id, {}).get("_health"))
            event = {"finished": "run.finished", "degraded": "run.finished", "failed": "run.failed",
                     "stopped": "run.stopped"}[shown]
            out.append(Notice(event, f"run:{run.id}:{run.status}:{_iso(run.finished_at)}", run.finished_at,
                              _payload(event, run.finished_at, f"run {run.id} is {shown}" +
                                       (f": {run.error}" if run.error else ""), run=_run_info(run, shown)),
                              run_id=run.id))
        return out

    def _lost_runs(self, now: dt.datetime) -> list[Notice]:
        timeout = self.settings.report_timeout_s
        with self.store.session() as s:
            runs = list(s.scalars(select(Run).where(Run.status.in_(LIVE_STATUSES))))
        out = []
        for run in runs:
            why = lost_reason(run, timeout, now)
            if why is None:
                continue
            if is_remote(run):
                last = run.last_report_at or run.created_at
                occurred, mark = last + dt.timedelta(seconds=timeout_of(run, timeout)), f"report:{_iso(last)}"
            else:
                occurred, mark = now, f"pid:{run.pid}:{_iso(run.started_at)}"
            out.append(Notice("run.lost", f"run:{run.id}:lost:{mark}", occurred,
                              _payload("run.lost", occurred, f"run {run.id} is lost: {why}",
                                       run=_run_info(run, "lost", why)), run_id=run.id))
        return out

    def _privacy(self, oldest: dt.datetime) -> list[Notice]:
        with self.store.session() as s:
            top = int(s.scalar(select(func.max(Event.id))) or 0)
            q = select(Event).where(Event.id > self._event_cursor, Event.id <= top, Event.kind == "privacy_budget")
            if self._event_cursor == 0:
                q = q.where(Event.ts >= oldest)
            events = list(s.scalars(q.order_by(Event.id)))
            runs = {r.id: r for r in s.scalars(select(Run).where(Run.id.in_({e.run_id for e in events if e.run_id})))}
        self._event_cursor = top
        out = []
        for e in events:
            run = runs.get(e.run_id or "")
            info = _run_info(run, shown_status(run, None)) if run is not None else {"id": e.run_id}
            out.append(Notice("run.privacy_budget", f"event:{e.id}", e.ts,
                              _payload("run.privacy_budget", e.ts, e.message, run=info), run_id=e.run_id))
        return out

    def _offline(self, lower: dt.datetime, now: dt.datetime) -> list[Notice]:
        window = dt.timedelta(seconds=ONLINE_WINDOW_S)
        with self.store.session() as s:
            nodes = list(s.scalars(select(Node).where(Node.kind.in_(FLEET_KINDS), not_(online_clause(now)),
                                                      Node.last_seen >= lower - window)))
        out = []
        for n in nodes:
            occurred = n.last_seen if n.status in DOWN_STATUSES else n.last_seen + window
            info = {"id": n.id, "kind": n.kind, "device_class": n.device_class, "run_id": n.run_id,
                    "status": n.status, "last_seen": _iso(n.last_seen)}
            out.append(Notice("node.offline", f"node:{n.id}:offline:{_iso(n.last_seen)}", occurred,
                              _payload("node.offline", occurred, f"node {n.id} is offline (last seen "
                                       f"{n.last_seen:%Y-%m-%d %H:%M:%S} UTC)", node=info),
                              run_id=n.run_id, node_id=n.id))
        return out

    def _enqueue(self, hooks: list[Webhook], notices: list[Notice]) -> int:
        wanted = [(h, n) for n in notices for h in hooks
                  if n.event in (h.events or []) and n.occurred_at >= h.created_at]
        if not wanted:
            return 0
        with self.store.session() as s:
            have = set(s.execute(select(WebhookDelivery.webhook_id, WebhookDelivery.event_key).where(
                WebhookDelivery.event_key.in_({n.key for _, n in wanted}))).all())
        added = 0
        for h, n in wanted:
            if (h.id, n.key) in have:
                continue
            breathe()
            try:
                with self.store.session() as s:
                    s.add(WebhookDelivery(webhook_id=h.id, event=n.event, event_key=n.key[:200], run_id=n.run_id,
                                          node_id=n.node_id, payload=n.payload, next_attempt_at=_now()))
                added += 1
            except IntegrityError:  # another dashboard queued it first
                pass
        return added

    # -- sending -----------------------------------------------------------------------
    def _send_loop(self) -> None:
        while not self._stop.is_set():
            try:
                wait = self.send_due()
            except Exception:
                log.exception("webhook sender: a pass failed")
                wait = self.settings.webhook_poll_s
            self._wake.wait(wait)
            self._wake.clear()

    def send_due(self) -> float:
        """Post every due delivery; returns how long to wait before the next is due."""
        now = _now()
        with self.store.session() as s:
            due = s.execute(select(WebhookDelivery, Webhook).join(Webhook).where(
                WebhookDelivery.status == "pending", WebhookDelivery.next_attempt_at <= now,
                Webhook.enabled.is_(True)).order_by(WebhookDelivery.id).limit(100)).all()
        for d, h in due:
            if self._stop.is_set():
                break
            breathe()
            if self._claim(d):
                self._post(d, h)
        with self.store.session() as s:
            nxt = s.scalar(select(func.min(WebhookDelivery.next_attempt_at)).where(WebhookDelivery.status == "pending"))
        if len(due) == 100:
            return 0.0
        wait = (nxt - _now()).total_seconds() if nxt is not None else self.settings.webhook_poll_s
        return max(0.0, min(wait, self.settings.webhook_poll_s))

    def _claim(self, d: WebhookDelivery) -> bool:
        with self.store.session() as s:
            res = s.execute(update(WebhookDelivery).where(
                WebhookDelivery.id == d.id, WebhookDelivery.status == "pending",
                WebhookDelivery.attempts == d.attempts).values(
                next_attempt_at=_now() + dt.timedelta(seconds=CLAIM_S), attempts=d.attempts + 1))
            return res.rowcount == 1

    def _post(self, d: WebhookDelivery, h: Webhook) -> None:
        body = body_of({**d.payload, "delivery_id": d.id})
        code, error = None, None
        try:
            secret = self.box.open(h.secret_sealed, h.id)
        except SecretUnavailable as exc:  # nothing unsigned or wrongly signed is sent
            self._record(d, None, f"not sent: {exc}", final=True)
            return
        headers = {"Content-Type": "application/json", SIGNATURE_HEADER: sign(secret, body),
                   "X-Fedswarm-Event": d.event, "X-Fedswarm-Delivery": str(d.id),
                   "User-Agent": f"fedswarm/{fedswarm.__version__}"}
        try:
            req = urllib.request.Request(h.url, data=body, headers=headers, method="POST")
            with self._opener.open(req, timeout=self.settings.webhook_timeout_s) as r:
                code = r.status
        except urllib.error.HTTPError as exc:  # an answer, not 2xx
            code = exc.code
            exc.close()
        except (OSError, ValueError) as exc:  # refused, timed out, unreachable
            error = f"{type(exc).__name__}: {exc}"[:500]
        if code is not None and not 200 <= code < 300:
            error = f"answered {code}"
        self._record(d, code, error)

    def _record(self, d: WebhookDelivery, code: int | None, error: str | None, final: bool = False) -> None:
        attempts = d.attempts + 1
        fields: dict[str, Any] = {"last_code": code, "last_error": error}
        if error is None:
            fields.update(status="delivered", delivered_at=_now())
        elif final or attempts >= self.settings.webhook_attempts:
            fields.update(status="failed")
        else:
            delay = self.settings.webhook_backoff_s * 2 ** (attempts - 1)
            fields.update(next_attempt_at=_now() + dt.timedelta(seconds=delay))
        with self.store.session() as s:
            s.execute(update(WebhookDelivery).where(WebhookDelivery.id == d.id).values(**fields))
