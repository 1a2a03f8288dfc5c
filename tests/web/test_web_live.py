"""Live updates over server-sent events from a real uvicorn process, and runs that outlive
the dashboard that started them."""

from __future__ import annotations

import datetime as dt
import json
import re
import time

import httpx

from dashboard_helpers import ADMIN_PW, start_server, wait_for
from fedswarm.store import Store
from fedswarm.web.services.launcher import pid_alive


def _login(url: str) -> httpx.Client:
    c = httpx.Client(base_url=url, timeout=60)
    tok = re.search(r'name="csrf_token" value="([^"]+)"', c.get("/login").text).group(1)
    c.post("/login", data={"username": "admin", "password": ADMIN_PW, "csrf_token": tok, "next": "/runs"})
    csrf = re.search(r'name="csrf-token" content="([^"]+)"', c.get("/runs").text).group(1)
    c.headers["X-CSRF-Token"] = csrf
    return c


def _events(response: httpx.Response, until, timeout: float):
    """(kind, data, received_at) from an SSE response until ``until(events)`` is true."""
    events, kind, end = [], None, time.monotonic() + timeout
    for line in response.iter_lines():
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            events.append((kind, json.loads(line[6:]), dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)))
            if until(events):
                return events
        if time.monotonic() > end:
            break
    raise AssertionError(f"stream ended early: {[e[:2] for e in events]}")


def test_rounds_stream_to_viewers_in_order_and_resume(fake_server):
    """Every round reaches a viewer once, in order, followed by the final status; a viewer
    that reconnects gets only what it missed. (How fast they arrive is a benchmark's
    business: ``fedswarm bench dashboard`` measures SSE delivery latency.)"""
    c = _login(fake_server.url)
    rid = c.post("/api/runs", json={"config": {"rounds": 5, "clients": 3}}).json()["id"]
    with c.stream("GET", f"/api/runs/{rid}/stream", timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = _events(r, lambda ev: any(k == "status" and d["status"] == "finished" for k, d, _ in ev)
                         and sum(k == "round" for k, _, _ in ev) == 5, timeout=120)
    assert [d["round"] for k, d, _ in events if k == "round"] == [1, 2, 3, 4, 5]
    # Reconnecting with Last-Event-ID sends only what was missed.
    with c.stream("GET", f"/api/runs/{rid}/stream", headers={"Last-Event-ID": "3"}, timeout=60) as r:
        again = _events(r, lambda ev: any(k == "status" for k, _, _ in ev), timeout=60)
    assert [d["round"] for k, d, _ in again if k == "round"] == [4, 5]


def test_global_stream_sends_run_summaries(fake_server):
    c = _login(fake_server.url)
    with c.stream("GET", "/api/stream", timeout=30) as r:
        rid = c.post("/api/runs", json={"config": {"rounds": 2}}).json()["id"]
        events = _events(r, lambda ev: any(k == "run" and d["id"] == rid and d["display_status"] == "finished"
                                           for k, d, _ in ev), timeout=120)
    last = [d for k, d, _ in events if k == "run" and d["id"] == rid][-1]
    assert last["rounds_done"] == 2 and last["bytes_up"] > 0


def test_stream_needs_login(fake_server):
    assert httpx.get(fake_server.url + "/api/stream").status_code == 401


def test_run_survives_a_dashboard_restart(tmp_path):
    server = start_server(tmp_path, fake=True, env={"FAKE_ROUND_S": "0.4"})
    try:
        c = _login(server.url)
        # long enough to be still running however slowly the dashboard restarts: the test stops it
        rid = c.post("/api/runs", json={"config": {"rounds": 1000}}).json()["id"]
        store = Store(server.db)
        wait_for(lambda: store.get_run(rid).status == "running")
    finally:
        server.stop()
    pid = store.get_run(rid).pid
    assert pid_alive(pid), "the run died with the dashboard"
    n = len(store.rounds(rid))
    wait_for(lambda: len(store.rounds(rid)) > n, timeout=60)  # it trains on with no dashboard
    server = start_server(tmp_path, fake=True)
    try:
        c = _login(server.url)
        assert c.get(f"/api/runs/{rid}").json()["display_status"] == "running"
        assert c.post(f"/api/runs/{rid}/stop").status_code == 200
        wait_for(lambda: store.get_run(rid).status == "stopped", timeout=60)
        wait_for(lambda: not pid_alive(pid), timeout=60)
    finally:
        server.stop()
