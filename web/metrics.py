"""Prometheus metrics of the dashboard: ``GET /metrics`` in the Prometheus text format
(``prometheus-client``), readable with a viewer token or a session.

Each app has its own :class:`~prometheus_client.CollectorRegistry` (tests build several apps in
one process). What it exports:

* ``fedswarm_runs{status}``: runs by the status a viewer sees (``lost``, ``degraded`` included);
* ``fedswarm_rounds_recorded``: training rounds recorded in the store (round 0, the initial
  evaluation, is not a round);
* ``fedswarm_nodes{state,device_class}``: nodes online/offline (:mod:`fedswarm.web.services.node_states`);
* ``fedswarm_ingest_requests_total{route}`` and ``fedswarm_ingest_rejections_total{reason}``:
  calls to ``/api/ingest`` and the ones refused, by reason
  (:data:`fedswarm.web.routers.api.ingest.REJECTION_REASONS`), counted where the refusal is answered
  (also the body caps and anonymous writes refused before routing);
* ``fedswarm_http_request_duration_seconds{method,route}``: time to the response's first byte,
  by route template (``/api/runs/{run_id}``; never a raw URL), and
  ``fedswarm_http_requests_total{method,route,status}``;
* ``fedswarm_sse_subscribers``: open live-update streams.

Counters and histograms export no ``_created`` series (``disable_created_metrics``, for the
process: the dashboard's registries are its only ones), which would double the series for nothing.

The store-derived figures are aggregate queries, recomputed at most every ``cache_s``; the
text is rendered at most every ``render_s`` (1 s), in a thread (never on the event loop, and
stepping aside for it between queries), while scrapes get the last one.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import threading
import time
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, disable_created_metrics,
                               generate_latest)
from prometheus_client.core import GaugeMetricFamily
from sqlalchemy import func, select
from starlette.routing import Match

from fedswarm.store import Round, Run
from fedswarm.web import models
from fedswarm.web.services.accounts import Principal
from fedswarm.web.routers.api.ingest import REJECTION_REASONS
from fedswarm.web.cache import breathe
from fedswarm.web.deps import require_reader
from fedswarm.web.services.node_states import node_state_counts
from fedswarm.web.services.queries import stats_for
from fedswarm.web.services.run_state import LIVE_STATUSES, Health, lost_reason, shown_status

__all__ = ["Metrics", "RouteTemplates", "router", "run_status_counts", "leaf_routes"]

log = logging.getLogger(__name__)
disable_created_metrics()
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
UNMATCHED = "(unmatched)"
router = APIRouter()


def run_status_counts(s, timeout_s: float) -> dict[str, int]:
    """Runs by display status: stored counts, live runs checked for ``lost``, finished runs for
    ``degraded``/``failed`` (the rules of :mod:`fedswarm.web.services.run_state`)."""
    out = {st: 0 for st in models.DISPLAY_STATUSES}
    for status, n in s.execute(select(Run.status, func.count()).group_by(Run.status)).all():
        if status not in LIVE_STATUSES and status != "finished":
            out[status] = out.get(status, 0) + int(n)
    for run in s.scalars(select(Run).where(Run.status.in_(LIVE_STATUSES))):
        out[shown_status(run, lost_reason(run, timeout_s))] += 1
    finished = list(s.scalars(select(Run.id).where(Run.status == "finished")))
    health = {rid: st.get("_health") for rid, st in stats_for(None, finished, s).items()} if finished else {}
    for rid in finished:
        h: Health | None = health.get(rid)
        out["failed" if h is not None and h.all_failed else "degraded" if h is not None and h.degraded
            else "finished"] += 1
    return out


class _StoreCollector:
    """Gauges read from the store (cached ``cache_s``) and the live hub."""

    def __init__(self, ctx: Any, cache_s: float):
        self.ctx, self.cache_s = ctx, cache_s
        self._lock = threading.Lock()
        self._at = -1e9
        self._snap: tuple[dict, int, dict] = ({}, 0, {})

    def _read(self) -> tuple[dict, int, dict]:
        with self._lock:
            if time.monotonic() - self._at > self.cache_s:
                now = dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)
                with self.ctx.store.session() as s:  # in the render thread, stepping aside between queries
                    runs = run_status_counts(s, self.ctx.settings.report_timeout_s)
                    breathe()
                    rounds = int(s.scalar(select(func.count()).select_from(Round).where(Round.round > 0)) or 0)
                    breathe()
                    nodes = node_state_counts(s, now)
                self._snap, self._at = (runs, rounds, nodes), time.monotonic()
            return self._snap

    def collect(self):
        runs, rounds, nodes = self._read()
        g = GaugeMetricFamily("fedswarm_runs", "Runs by the status a viewer sees (lost and degraded included).",
                              labels=["status"])
        for status, n in sorted(runs.items()):
            g.add_metric([status], n)
        yield g
        yield GaugeMetricFamily("fedswarm_rounds_recorded", "Training rounds recorded in the store (round 0, the "
                                "initial evaluation, not counted).", value=rounds)
        g = GaugeMetricFamily("fedswarm_nodes", "Nodes by state and device class: fleet nodes (supernode, peer) "
                              "and simulated nodes of live runs.", labels=["state", "device_class"])
        for (state, dc), n in sorted(nodes.items()):
            g.add_metric([state, dc], n)
        yield g
        yield GaugeMetricFamily("fedswarm_sse_subscribers", "Open live-update (server-sent events) streams.",
                                value=self._viewers())

    def _viewers(self) -> int:
        for _ in range(5):  # the hub's subscriber sets change on the event loop while this thread reads
            try:
                return self.ctx.hub.viewers
            except RuntimeError:
                continue
        return 0


class Metrics:
    """The registry of one dashboard app and its instruments."""

    def __init__(self, ctx: Any, cache_s: float = 2.0, render_s: float = 1.0):
        self.render_s = render_s
        self._text: bytes | None = None
        self._text_at = 0.0
        self._rendering: asyncio.Task | None = None
        self.registry = CollectorRegistry(auto_describe=False)
        self.http_seconds = Histogram("fedswarm_http_request_duration_seconds",
                                      "Time to the first byte of the response, by route template.",
                                      ["method", "route"], buckets=BUCKETS, registry=self.registry)
        self.http_requests = Counter("fedswarm_http_requests", "HTTP requests answered, by route template and "
                                     "status.", ["method", "route", "status"], registry=self.registry)
        self.ingest_requests = Counter("fedswarm_ingest_requests", "Calls to /api/ingest, by route template.",
                                       ["route"], registry=self.registry)
        self.ingest_rejections = Counter("fedswarm_ingest_rejections", "Calls to /api/ingest refused, by reason.",
                                         ["reason"], registry=self.registry)
        for reason in sorted(set(REJECTION_REASONS.values()) | {"other"}):
            self.ingest_rejections.labels(reason)  # present at 0 from the start
        self._series: dict[tuple[str, str, int], tuple[Any, Any]] = {}
        self.store_figures = _StoreCollector(ctx, cache_s)
        self.registry.register(self.store_figures)

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        """Count one answered request (called on every request: the labelled children are looked
        up once per (method, route, status) and kept, the label checks of ``labels()`` skipped)."""
        key = (method, route, status)
        series = self._series.get(key)
        if series is None:
            if len(self._series) >= 4096:  # routes are templates, statuses few: a bound, never reached
                self._series.clear()
            series = self._series[key] = (self.http_seconds.labels(method, route),
                                          self.http_requests.labels(method, route, str(status)))
        series[0].observe(seconds)
        series[1].inc()
        if route.startswith("/api/ingest/"):
            self.ingest_requests.labels(route).inc()
            if status >= 400:
                self.ingest_rejections.labels(REJECTION_REASONS.get(status, "other")).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    async def text(self) -> bytes:
        """The exposition, rendered at most every ``render_s`` in a worker thread: a scrape is
        answered from memory on the event loop while a newer one is rendered (stale while
        revalidate), so no scrape waits on the store's queries but the first."""
        now = time.monotonic()
        if self._text is None:
            self._text, self._text_at = await asyncio.to_thread(self.render), now
        elif now - self._text_at > self.render_s and self._rendering is None:
            self._rendering = asyncio.create_task(self._rerender())
        return self._text

    async def _rerender(self) -> None:
        try:
            text = await asyncio.to_thread(self.render)
            self._text, self._text_at = text, time.monotonic()
        except Exception:  # the store may be briefly unreachable; the last text stays
            log.exception("rendering /metrics failed")
        finally:
            self._rendering = None


def leaf_routes(routes: list) -> list:
    """The routes that answer requests, with routers included into others walked through."""
    out = []
    for r in routes:
        inner = getattr(r, "original_router", None)  # FastAPI's wrapper of an included router
        out.extend(leaf_routes(inner.routes) if inner is not None else [r])
    return out


class RouteTemplates:
    """The route template that labels a request's metrics: the one that answered it; for a
    request answered before routing (a cached read, a refusal of the dashboard's middleware,
    :class:`fedswarm.web.middleware.Edge`, which times every request), the template its path was
    routed to before, else the first route that matches it (remembered, bounded); a path no
    route matches is ``(unmatched)``."""

    MEMO = 4096

    def __init__(self, routes: Any):
        self.router = routes
        self._leaves: list | None = None
        self._memo: dict[tuple[str, str], str] = {}

    def _remember(self, key: tuple[str, str], template: str) -> None:
        if len(self._memo) >= self.MEMO:
            self._memo.clear()
        self._memo[key] = template

    def __call__(self, scope) -> str:
        key = (scope["method"], scope["path"])
        route = scope.get("route")
        if route is not None and getattr(route, "path", None):
            if key not in self._memo:
                self._remember(key, route.path)
            return route.path
        hit = self._memo.get(key)
        if hit is None:
            if self._leaves is None:
                self._leaves = leaf_routes(self.router.routes)
            hit = next((getattr(r, "path", "") or UNMATCHED for r in self._leaves
                        if r.matches(scope)[0] == Match.FULL), UNMATCHED)
            if hit != UNMATCHED:
                self._remember(key, hit)
        return hit


@router.get("/metrics", response_class=Response, tags=["meta"],
            responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"},
                       401: {"model": models.Message}, 403: {"model": models.Message}})
async def metrics(request: Request, _: Principal = Depends(require_reader)) -> Response:
    """Prometheus metrics (text format 0.0.4): runs by shown status, rounds recorded, nodes by
    state and device class, ingest requests and rejections by reason, HTTP latency by route
    template, live-update subscribers. Readable with a viewer token or a session."""
    return Response(await request.app.state.metrics.text(), media_type=CONTENT_TYPE_LATEST)
