"""GET /metrics: scraped and parsed with prometheus_client's own parser."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from dashboard_helpers import bearer, make_token, wait_for
from fedswarm.web.app import create_app


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _scrape(client, headers) -> dict[tuple[str, tuple], float]:
    r = client.get("/metrics", headers=headers)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _seed(store) -> None:
    old = dt.datetime.now(dt.timezone.utc).replace(tzinfo=None) - dt.timedelta(hours=1)
    store.create_run({}, run_id="done", status="finished")
    store.create_run({}, run_id="stopped", status="stopped")
    store.create_run({}, run_id="dead", status="running")
    store.update_run("dead", pid=_dead_pid())  # its process is gone: lost
    store.create_run({}, run_id="silent", status="running")
    store.update_run("silent", owner="token:1", last_report_at=old)  # a reporter gone quiet: lost
    store.create_run({}, run_id="alive", status="running")  # no pid, not remote: shown running
    store.create_run({}, run_id="allfail", status="finished")
    store.add_round("allfail", 1)
    store.add_node_rounds("allfail", 1, [{"node_id": "x", "status": "failed"}])  # every node failed: failed
    store.add_round("done", 0)  # the initial evaluation: not a round
    store.add_round("done", 1)
    store.add_round("done", 2)
    store.upsert_node("sn1", kind="supernode", device_class="gpu")
    store.upsert_node("sn2", kind="supernode", device_class="gpu")
    store.upsert_node("p1", kind="peer", device_class="edge-wifi", status="offline")
    store.upsert_node("p2", kind="peer")
    with store.session() as s:
        from fedswarm.store import Node

        s.get(Node, "p2").last_seen = old  # not heard from for an hour
    store.upsert_node("alive:1", kind="sim", run_id="alive", device_class="cpu")
    store.upsert_node("done:1", kind="sim", run_id="done", device_class="cpu")  # a finished run's: not counted


def test_metrics_count_runs_rounds_nodes(app, viewer):
    store = app.state.ctx.store
    _seed(store)
    m = _scrape(viewer, {})  # a viewer's session may read it
    runs = {dict(k[1])["status"]: v for k, v in m.items() if k[0] == "fedswarm_runs"}
    assert runs == {"pending": 0, "running": 1, "paused": 0, "finished": 1, "failed": 1, "stopped": 1,
                    "lost": 2, "degraded": 0}
    assert m[("fedswarm_rounds_recorded", ())] == 3  # rounds 1 and 2 of "done", 1 of "allfail"; not round 0
    nodes = {(dict(k[1])["state"], dict(k[1])["device_class"]): v for k, v in m.items() if k[0] == "fedswarm_nodes"}
    assert nodes == {("online", "gpu"): 2, ("offline", "edge-wifi"): 1, ("offline", "unknown"): 1,
                     ("online", "cpu"): 1}
    assert m[("fedswarm_sse_subscribers", ())] == 0


def test_http_latency_by_route_template_and_ingest_rejections(app, admin):
    token = make_token(app, "viewer")
    reporter = make_token(app, "reporter")
    admin.get("/api/runs/some-run-id")  # 404, still timed under its template
    admin.get("/api/runs")
    admin.get("/api/runs")  # answered by the cached-read fast path, before routing
    admin.post("/api/ingest/runs", json={"run_id": "r1"}, headers=bearer(reporter))
    admin.post("/api/ingest/runs", json={"run_id": "r1"}, headers=bearer(reporter))  # 409: exists
    admin.post("/api/ingest/runs", json={"bogus": 1}, headers=bearer(reporter))  # 422
    admin.post("/api/ingest/nodes", json={"node_id": "n"}, headers=bearer("fs_nope"))  # 401
    admin.post("/api/ingest/runs", content=b"x" * 100_000, headers={**bearer(reporter),
                                                                     "content-type": "application/json"})  # 413
    q = app.state.ctx.hub.subscribe(None)
    m = _scrape(admin, bearer(token))
    labels = [dict(k[1]) for k in m if k[0].startswith("fedswarm_http_request")]
    routes = {x["route"] for x in labels}
    assert {"/api/runs/{run_id}", "/api/runs", "/api/ingest/runs", "/api/ingest/nodes"} <= routes
    assert not any("some-run-id" in r for r in routes)
    count = {(d["route"], d["status"]): v for k, v in m.items() if k[0] == "fedswarm_http_requests_total"
             for d in [dict(k[1])]}
    assert count[("/api/runs", "200")] == 2 and count[("/api/runs/{run_id}", "404")] == 1
    hist = m[("fedswarm_http_request_duration_seconds_count", (("method", "GET"), ("route", "/api/runs")))]
    assert hist == 2
    assert m[("fedswarm_ingest_requests_total", (("route", "/api/ingest/runs"),))] == 4
    rej = {dict(k[1])["reason"]: v for k, v in m.items() if k[0] == "fedswarm_ingest_rejections_total"}
    assert rej["conflict"] == 1 and rej["invalid"] == 1 and rej["unauthenticated"] == 1 and rej["too_large"] == 1
    assert rej["rate_limited"] == 0
    assert m[("fedswarm_sse_subscribers", ())] == 1
    app.state.ctx.hub.unsubscribe(None, q)
    # Counters and histograms have samples, and none of them is a _created timestamp.
    assert any(k[0].endswith("_total") for k in m) and any(k[0].endswith("_bucket") for k in m)
    assert [k for k in m if k[0].endswith("_created")] == []


def test_metrics_need_a_reader_and_each_app_has_its_own_registry(tmp_path, anon, app):
    assert anon.get("/metrics").status_code == 401
    assert anon.get("/metrics", headers=bearer(make_token(app, "reporter"))).status_code == 403
    other = create_app(str(tmp_path / "other.db"), admin_password="admin-password-1", catalog_cmd=["true"])
    with TestClient(other) as c:
        m = _scrape(c, bearer(make_token(other, "viewer")))
    assert m[("fedswarm_rounds_recorded", ())] == 0


def test_scrapes_are_served_from_the_last_rendering_while_a_newer_one_is_made(app, admin):
    m = app.state.metrics
    store = app.state.ctx.store
    store.create_run({}, run_id="r", status="running")
    assert _scrape(admin, {})[("fedswarm_rounds_recorded", ())] == 0
    store.add_round("r", 1)
    assert _scrape(admin, {})[("fedswarm_rounds_recorded", ())] == 0  # within render_s: the last text
    m.render_s = m.store_figures.cache_s = 0.0
    wait_for(lambda: _scrape(admin, {})[("fedswarm_rounds_recorded", ())] == 1, timeout=20)
