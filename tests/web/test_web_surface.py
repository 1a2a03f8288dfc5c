"""A smaller attack surface and honest state: what the web may start (registered tasks, uploaded
files, never import paths or server paths), run ids checked everywhere, tokens that expire,
no-store caching, Secure cookies over HTTPS, schema migration of an old store, liveness of
remote runs, "degraded" runs, action validity, and the runs list's search/filter/sort/paging."""

from __future__ import annotations

import datetime as dt
import re
import sqlite3

from fastapi.testclient import TestClient

from dashboard_helpers import ADMIN_PW, bearer, login, make_token, wait_for
from fedswarm.store import Store
from fedswarm.web.tables import ApiToken


def test_web_starts_only_registered_tasks_and_uploaded_files(app, admin):
    refused = {
        "'task'": {"task": "os:getpid"},
        "'topology'": {"topology": "edges:/etc/passwd"},
        "'profiles'": {"profiles": "/etc/passwd", "devices": "gpu:2"},
    }
    for needle, config in refused.items():
        r = admin.post("/api/runs", json={"config": {"rounds": 2, "clients": 2, **config}})
        assert r.status_code == 422 and needle in r.json()["detail"], r.text
        assert "root:" not in r.text
    assert admin.get("/api/runs").json() == []
    # An uploaded edge list is checked, kept in the run's own folder and used.
    r = admin.post("/api/runs", json={"config": {"rounds": 1, "clients": 3, "topology": "edges"},
                                      "topology_edges": "0 1\n1 2\n"})
    assert r.status_code == 201, r.text
    rid = r.json()["id"]
    topo = app.state.ctx.store.get_run(rid).config["topology"]
    assert topo == f"edges:{app.state.ctx.settings.runs_dir / rid / 'topology.edges'}"
    r = admin.post("/api/runs", json={"config": {"rounds": 1, "clients": 3}, "topology_edges": "0 1\n1 7\n"})
    assert r.status_code == 422 and "line 2" in r.json()["detail"]


def test_form_refuses_import_path_task(app, admin):
    form = {"csrf_token": admin.headers["X-CSRF-Token"], "task": "os:system", "strategy": "fedavg", "rounds": "2"}
    r = admin.post("/runs/new", data=form)
    assert r.status_code == 422 and "import path" in r.text
    assert app.state.ctx.store.list_runs() == []


def test_run_ids_are_validated_everywhere(app, admin):
    for path in ("/api/runs/%2E%2E", "/api/runs/%2E%2E/log", "/api/runs/%2E%2E/rounds",
                 "/api/events?run_id=..", "/api/policies?run_id=..", "/runs/%2E%2E"):
        assert admin.get(path).status_code == 422, path
    assert admin.post("/api/runs/%2E%2E/pause").status_code == 422
    assert admin.post("/api/tokens", json={"name": "t", "run_id": ".."}).status_code == 422


def test_tokens_expire_and_record_last_use(app, admin, anon):
    t = admin.post("/api/tokens", json={"name": "short", "role": "viewer", "expires_in_days": 1}).json()
    assert t["expires_at"] is not None
    assert anon.get("/api/runs", headers=bearer(t["token"])).status_code == 200
    listed = {x["id"]: x for x in admin.get("/api/tokens").json()}
    assert listed[t["id"]]["last_used_at"] is not None
    other = admin.post("/api/tokens", json={"name": "old", "role": "viewer"}).json()
    with app.state.ctx.store.session() as s:
        s.get(ApiToken, other["id"]).expires_at = dt.datetime(2000, 1, 1)
    assert anon.get("/api/runs", headers=bearer(other["token"])).status_code == 401
    assert admin.post("/api/tokens", json={"name": "x", "expires_in_days": 0}).status_code == 422


def test_no_store_on_secrets_and_pages_but_static_caches(app, admin):
    r = admin.post("/admin/tokens", data={"csrf_token": admin.headers["X-CSRF-Token"], "name": "p", "role": "reporter"})
    assert "fst_" in r.text and r.headers["cache-control"] == "no-store"
    assert admin.post("/api/tokens", json={"name": "q"}).headers["cache-control"] == "no-store"
    for path in ("/runs", "/admin", "/api/runs", "/api/whoami"):
        assert admin.get(path).headers["cache-control"] == "no-store", path
    assert "no-store" not in admin.get("/static/charts.js").headers.get("cache-control", "")


def test_secure_cookies_and_hsts_over_https(make_app):
    app = make_app(https=True)
    with TestClient(app, base_url="https://dash.example") as c:
        page = c.get("/login")
        assert "secure" in page.headers["set-cookie"].lower()
        token = re.search(r'name="csrf_token" value="([^"]+)"', page.text).group(1)
        r = c.post("/login", data={"username": "admin", "password": ADMIN_PW, "csrf_token": token, "next": "/runs"},
                   follow_redirects=False)
        cookies = r.headers.get_list("set-cookie")
        assert all("secure" in h.lower() for h in cookies if h.startswith("fedswarm_session")), cookies
        assert r.headers["strict-transport-security"].startswith("max-age=")
    plain = make_app()
    with TestClient(plain) as c:
        assert "secure" not in c.get("/login").headers["set-cookie"].lower()


def test_old_store_is_migrated_in_place(tmp_path):
    db = tmp_path / "old.db"
    con = sqlite3.connect(db)
    con.executescript("""
        CREATE TABLE runs (id VARCHAR(36) PRIMARY KEY, name VARCHAR(200), status VARCHAR(16), strategy VARCHAR(64),
          task VARCHAR(200), engine VARCHAR(32), config JSON, seed INTEGER, code_version VARCHAR(64),
          total_rounds INTEGER, created_at DATETIME, started_at DATETIME, finished_at DATETIME, error TEXT,
          pid INTEGER, summary JSON);
        CREATE TABLE rounds (id INTEGER PRIMARY KEY AUTOINCREMENT, run_id VARCHAR(36), round INTEGER,
          train_loss FLOAT, test_loss FLOAT, test_accuracy FLOAT, bytes_up BIGINT, bytes_down BIGINT, wall_s FLOAT,
          sim_time_s FLOAT, num_clients INTEGER, metrics JSON, created_at DATETIME, UNIQUE (run_id, round));
        INSERT INTO runs VALUES ('old1', 'before', 'finished', 'fedavg', 'digits-mlp', 'inprocess', '{}', 0, '0.1',
          2, '2026-01-01 00:00:00', NULL, NULL, NULL, NULL, '{}');
        INSERT INTO rounds (run_id, round, test_accuracy, bytes_up, bytes_down, wall_s, num_clients, metrics,
          created_at) VALUES ('old1', 1, 0.5, 10, 20, 0.1, 2, '{}', '2026-01-01 00:00:01');
    """)
    con.commit()
    con.close()
    store = Store(db)
    cols = {r[1] for r in sqlite3.connect(db).execute("PRAGMA table_info(rounds)")}
    assert {"reported_by", "node_rows", "failed_node_rows"} <= cols
    assert store.get_run("old1").owner is None and store.rounds("old1")[0].test_accuracy == 0.5
    store.add_node_rounds("old1", 1, [{"node_id": "a", "status": "failed"}])
    assert (store.rounds("old1")[0].node_rows, store.rounds("old1")[0].failed_node_rows) == (1, 1)
    Store(db)  # a second open changes nothing


def test_silent_remote_run_shows_lost_with_its_timeout(app, anon, admin):
    token = make_token(app, "reporter")
    r = anon.post("/api/ingest/runs", json={"run_id": "far", "lost_after_s": 30}, headers=bearer(token))
    assert r.status_code == 201
    run = admin.get("/api/runs/far").json()
    assert run["display_status"] == "running" and run["lost_after_s"] == 30 and run["remote"]
    with app.state.ctx.store.session() as s:
        from fedswarm.store import Run

        s.get(Run,
              "far").last_report_at = dt.datetime.now(dt.timezone.utc).replace(tzinfo=None) - dt.timedelta(seconds=31)
    app.state.ctx.cache.clear()
    run = admin.get("/api/runs/far").json()
    assert run["display_status"] == "lost" and "no report for over 30 s" in run["lost_reason"]
    assert run["actions"]["stop"] is None and run["actions"]["pause"] is not None
    # A report brings it back.
    assert anon.post("/api/ingest/runs/far/rounds", json={"round": 1}, headers=bearer(token)).status_code == 201
    app.state.ctx.cache.clear()
    assert admin.get("/api/runs/far").json()["display_status"] == "running"


def test_finished_run_whose_nodes_failed_is_degraded_not_green(app, anon, admin):
    token = bearer(make_token(app, "reporter"))
    for rid, fail_rounds in (("mostly-failed", {1, 2, 3}), ("all-failed", {1, 2, 3, 4}), ("healthy", {4})):
        anon.post("/api/ingest/runs", json={"run_id": rid}, headers=token)
        for r in range(1, 5):
            nodes = [{"node_id": f"n{k}", "status": "failed" if r in fail_rounds and (k < 3 or rid == "all-failed")
                      else "ok", "reason": "bad codec"} for k in range(4)]
            assert anon.post(f"/api/ingest/runs/{rid}/rounds", json={"round": r, "nodes": nodes},
                             headers=token).status_code == 201
        anon.post(f"/api/ingest/runs/{rid}/status", json={"status": "finished"}, headers=token)
    shown = {r["id"]: r for r in admin.get("/api/runs").json()}
    assert shown["mostly-failed"]["display_status"] == "degraded"
    assert shown["mostly-failed"]["failed_node_rounds"] == 9 and shown["mostly-failed"]["bad_rounds"] == 3
    assert shown["all-failed"]["display_status"] == "failed"
    assert shown["healthy"]["display_status"] == "finished"
    page = admin.get("/runs/mostly-failed").text
    assert "Nodes failing" in page and "9 of 16 node-rounds" in page and "degraded" in page


def test_actions_valid_only_in_their_states(app, admin, monkeypatch):
    monkeypatch.setenv("FAKE_ROUND_S", "0.3")
    rid = admin.post("/api/runs", json={"config": {"rounds": 40}}).json()["id"]
    wait_for(lambda: admin.get(f"/api/runs/{rid}").json()["display_status"] == "running")
    actions = admin.get(f"/api/runs/{rid}").json()["actions"]
    assert actions["pause"] is None and actions["stop"] is None and actions["add_rounds"] is None
    assert "not paused" in actions["resume"] and actions["restart"] is not None
    r = admin.post(f"/api/runs/{rid}/resume")
    assert r.status_code == 409 and "not paused" in r.json()["detail"]
    assert admin.post(f"/api/runs/{rid}/pause").status_code == 200
    assert admin.post(f"/api/runs/{rid}/pause").status_code == 409  # waiting, or applied: paused
    admin.post(f"/api/runs/{rid}/stop?force=true")
    stopped = admin.get(f"/api/runs/{rid}").json()
    assert stopped["actions"]["add_rounds"] is not None
    r = admin.post(f"/api/runs/{rid}/add_rounds", json={"rounds": 2})
    assert r.status_code == 409 and "live run" in r.json()["detail"]
    assert re.search(r'id="btn-add_rounds"\s+disabled', admin.get(f"/runs/{rid}").text)


def test_runs_list_search_filter_sort_and_pages(app, admin):
    store = app.state.ctx.store
    for i in range(7):
        rid = store.create_run({"strategy": "topk" if i % 2 else "fedavg", "rounds": 3}, name=f"exp-{i}",
                               status="finished" if i < 5 else "failed")
        store.add_round(rid, 1, test_accuracy=i / 10)
    r = admin.get("/api/runs?limit=3&offset=0")
    assert r.headers["x-total-count"] == "7" and len(r.json()) == 3
    assert [x["name"] for x in admin.get("/api/runs?sort=accuracy&limit=2").json()] == ["exp-6", "exp-5"]
    assert {x["strategy"] for x in admin.get("/api/runs?strategy=topk").json()} == {"topk"}
    assert [x["name"] for x in admin.get("/api/runs?status=failed&sort=name&order=asc").json()] == ["exp-5", "exp-6"]
    assert [x["name"] for x in admin.get("/api/runs?q=EXP-3").json()] == ["exp-3"]
    page = admin.get("/runs?strategy=topk&sort=name&order=asc").text
    assert page.index("exp-1") < page.index("exp-3") and "exp-2" not in page


def test_docs_served_from_the_installed_package(anon):
    page = anon.get("/docs")
    assert page.status_code == 200 and "/docs/assets/swagger-ui-bundle.js" in page.text
    assert "cdn" not in page.text.lower() and "<script>" not in page.text  # no inline script
    assert anon.get("/docs/assets/swagger-ui-bundle.js").status_code == 200
    assert "default-src 'self'" in page.headers["content-security-policy"]


def test_login_helper_still_works(app):
    with TestClient(app) as c:
        assert login(c, "admin", ADMIN_PW)


def test_startup_error_shown_on_the_run_page(app, admin, monkeypatch):
    """A run whose process dies at start is lost with its log's last lines as the error."""
    monkeypatch.setenv("FAKE_FAIL", "1")
    rid = admin.post("/api/runs", json={"config": {"rounds": 3}}).json()["id"]
    wait_for(lambda: admin.get(f"/api/runs/{rid}").json()["display_status"] == "lost")
    run = admin.get(f"/api/runs/{rid}").json()
    assert "ended without reporting" in run["error"] and "failing on purpose" in run["error"]
    assert "failing on purpose" in admin.get(f"/runs/{rid}").text.split('id="run-error"')[1][:600]


def test_status_reason_and_error_read_liveness_once(app, admin, monkeypatch):
    """A process that dies between two liveness reads of one answer must not show as lost
    with no error (the startup-error test failed so once in a repeat loop), nor as running
    with a lost reason: each answer reads it once."""
    store = app.state.ctx.store
    rid = store.create_run({"rounds": 3}, status="running")
    store.update_run(rid, pid=424242)
    calls = []

    def alive_then_dead(pid):
        calls.append(pid)
        return len(calls) == 1  # alive at the first read of each answer, dead after

    monkeypatch.setattr("fedswarm.store.liveness.pid_alive", alive_then_dead)
    for path in (f"/api/runs/{rid}", "/api/runs"):
        app.state.ctx.cache.clear()
        calls.clear()
        shown = admin.get(path).json()
        for run in shown if isinstance(shown, list) else [shown]:
            if run["id"] == rid:
                assert (run["display_status"] == "lost") == (run["lost_reason"] is not None), run
                assert (run["display_status"] == "lost") == (run["error"] is not None), run


def test_resume_from_checkpoint_only_when_possible(app, admin, monkeypatch, tmp_path):
    """The Resume-from-checkpoint action calls `RUNNER resume RUN_ID`, for a failed or lost run
    of this dashboard that has a checkpoint, and only then."""
    monkeypatch.setenv("FAKE_ROUND_S", "0.05")
    monkeypatch.setenv("FAKE_DIE_AFTER", "3")
    monkeypatch.setenv("FAKE_DIE_GATE", str(tmp_path / "die"))  # it stays running (3 checkpoints) until told
    assert app.state.ctx.runs.resume_command_available()
    rid = admin.post("/api/runs", json={"config": {"rounds": 6}}).json()["id"]
    wait_for(lambda: len(admin.get(f"/api/runs/{rid}/rounds").json()) == 3)
    live = admin.get(f"/api/runs/{rid}").json()
    assert live["display_status"] == "running"
    assert live["actions"]["restart"] is not None  # running, with checkpoints: still nothing to resume
    (tmp_path / "die").write_text("")
    wait_for(lambda: admin.get(f"/api/runs/{rid}").json()["display_status"] == "lost")
    assert admin.get(f"/api/runs/{rid}").json()["actions"]["restart"] is None
    r = admin.post(f"/api/runs/{rid}/restart")
    assert r.status_code == 200 and "after round" not in r.json()["detail"], r.text
    wait_for(lambda: admin.get(f"/api/runs/{rid}").json()["display_status"] == "finished")
    assert [x["round"] for x in admin.get(f"/api/runs/{rid}/rounds").json()] == [1, 2, 3, 4, 5, 6]
    assert admin.post(f"/api/runs/{rid}/restart").status_code == 409  # finished: nothing to resume
    # A run without a checkpoint cannot be resumed.
    monkeypatch.setenv("FAKE_FAIL", "1")
    other = admin.post("/api/runs", json={"config": {"rounds": 2}}).json()["id"]
    wait_for(lambda: admin.get(f"/api/runs/{other}").json()["display_status"] == "lost")
    r = admin.post(f"/api/runs/{other}/restart")
    assert r.status_code == 409 and "checkpoint" in r.json()["detail"]


def test_device_classes_shown_when_node_rows_lack_them(app, admin):
    """Decentralized runs' node rows carry no class: the in-process engine's node i+1 is
    partition i, whose class the run's devices spec names."""
    store = app.state.ctx.store
    rid = store.create_run({"strategy": "dpsgd", "engine": "inprocess", "devices": "gpu:1,edge-wifi:3", "rounds": 1})
    store.add_round(rid, 1, test_accuracy=0.5, metrics={"consensus_distance": 0.2})
    store.add_node_rounds(rid, 1, [{"node_id": str(i), "bytes_up": 10} for i in range(1, 5)])
    detail = admin.get(f"/api/runs/{rid}").json()
    assert {n["node_id"]: n["device_class"] for n in detail["nodes"]} == {
        "1": "gpu", "2": "edge-wifi", "3": "edge-wifi", "4": "edge-wifi"}
    assert {d["device_class"]: d["nodes"] for d in detail["device_classes"]} == {"gpu": 1, "edge-wifi": 3}


def test_pending_control_visible_until_applied(app, anon, admin):
    token = bearer(make_token(app, "reporter"))
    anon.post("/api/ingest/runs", json={"run_id": "slow-peer"}, headers=token)
    assert admin.post("/api/runs/slow-peer/pause").status_code == 200
    page = admin.get("/runs/slow-peer").text
    assert re.search(r'id="pending" class="pending"', page) and "pause — requested by admin" in page
    assert admin.get("/api/runs/slow-peer").json()["pending"] == ["pause"]
    cid = anon.get("/api/ingest/runs/slow-peer/controls", headers=token).json()[0]["id"]
    anon.post(f"/api/ingest/runs/slow-peer/controls/{cid}/applied", headers=token)
    anon.post("/api/ingest/runs/slow-peer/status", json={"status": "paused"}, headers=token)
    app.state.ctx.cache.clear()
    assert 'id="pending" class="pending hidden"' in admin.get("/runs/slow-peer").text
    assert admin.get("/api/runs/slow-peer").json()["actions"]["resume"] is None
