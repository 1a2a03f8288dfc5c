"""Ingest authorization by ownership: a reporter token acts only on runs it registered or is
bound to. For every ingest route, a foreign token gets 403 and the run (its status, rounds,
nodes, controls and events) is exactly as before."""

from __future__ import annotations

import pytest
from sqlalchemy import text

from dashboard_helpers import bearer, make_token


def _register(anon, token: str, run_id: str) -> None:
    r = anon.post("/api/ingest/runs", json={"run_id": run_id, "config": {"strategy": "dpsgd", "rounds": 5}},
                  headers=bearer(token))
    assert r.status_code == 201, r.text


def _snapshot(app, run_id: str) -> tuple:
    store = app.state.ctx.store
    run = store.get_run(run_id)
    with store.session() as s:
        counts = tuple(s.execute(text(f"SELECT count(*) FROM {t} WHERE run_id = :r"), {"r": run_id}).scalar()
                       for t in ("rounds", "node_rounds", "nodes", "controls", "events"))
        applied = tuple(s.execute(text("SELECT id, applied_at FROM controls WHERE run_id = :r ORDER BY id"),
                                  {"r": run_id}).all())
        nodes = tuple(s.execute(text("SELECT id, run_id, status, device_class FROM nodes ORDER BY id")).all())
    return run.status, run.total_rounds, run.error, counts, applied, nodes


@pytest.fixture
def two_reporters(app, anon, admin):
    """Run 'mine' registered by token A (with a node and a pending stop), and token B."""
    a, b = make_token(app, "reporter"), make_token(app, "reporter")
    _register(anon, a, "mine")
    assert anon.post("/api/ingest/runs/mine/rounds", json={"round": 1, "test_accuracy": 0.5},
                     headers=bearer(a)).status_code == 201
    assert anon.post("/api/ingest/nodes", json={"node_id": "peer-a", "run_id": "mine", "device_class": "gpu"},
                     headers=bearer(a)).status_code == 200
    assert admin.post("/api/runs/mine/stop").status_code == 200
    return a, b


def _control_id(app) -> int:
    return app.state.ctx.store.pending_controls("mine")[0].id


FOREIGN_CALLS = {
    "status": lambda anon, h, cid: anon.post("/api/ingest/runs/mine/status", json={"status": "finished"}, headers=h),
    "rounds": lambda anon, h, cid: anon.post("/api/ingest/runs/mine/rounds",
                                             json={"round": 92_561, "test_accuracy": 0.999, "bytes_up": 26 * 10**12},
                                             headers=h),
    "controls": lambda anon, h, cid: anon.get("/api/ingest/runs/mine/controls", headers=h),
    "control_applied": lambda anon, h, cid: anon.post(f"/api/ingest/runs/mine/controls/{cid}/applied", headers=h),
    "nodes_with_run": lambda anon, h, cid: anon.post("/api/ingest/nodes", json={"node_id": "peer-x", "run_id": "mine"},
                                                     headers=h),
    "nodes_without_run": lambda anon, h, cid: anon.post("/api/ingest/nodes",
                                                        json={"node_id": "peer-a", "status": "offline"}, headers=h),
    "register_existing": lambda anon, h, cid: anon.post("/api/ingest/runs", json={"run_id": "mine"}, headers=h),
}


@pytest.mark.parametrize("route", sorted(FOREIGN_CALLS))
def test_foreign_token_is_refused_and_the_run_untouched(app, anon, two_reporters, route):
    _, foreign = two_reporters
    cid = _control_id(app)
    before = _snapshot(app, "mine")
    r = FOREIGN_CALLS[route](anon, bearer(foreign), cid)
    expected = 409 if route == "register_existing" else 403  # it exists; it is still not B's
    assert r.status_code == expected, r.text
    assert _snapshot(app, "mine") == before


@pytest.mark.parametrize("route", sorted(set(FOREIGN_CALLS) - {"register_existing"}))
def test_token_bound_to_another_run_is_refused(app, anon, admin, two_reporters, route):
    app.state.ctx.store.create_run({"rounds": 1}, run_id="elsewhere")
    bound = make_token(app, "reporter", run_id="elsewhere")
    cid = _control_id(app)
    before = _snapshot(app, "mine")
    r = FOREIGN_CALLS[route](anon, bearer(bound), cid)
    assert r.status_code == 403, r.text
    assert _snapshot(app, "mine") == before


def test_owner_and_admin_token_may_act_and_are_recorded(app, anon, two_reporters):
    owner, _ = two_reporters
    store = app.state.ctx.store
    cid = _control_id(app)
    assert anon.get("/api/ingest/runs/mine/controls", headers=bearer(owner)).json()[0]["kind"] == "stop"
    assert anon.post(f"/api/ingest/runs/mine/controls/{cid}/applied", headers=bearer(owner)).status_code == 200
    assert anon.post("/api/ingest/runs/mine/rounds", json={"round": 2}, headers=bearer(owner)).status_code == 201
    admin_token = make_token(app, "admin")
    assert anon.post("/api/ingest/runs/mine/status", json={"status": "stopped"},
                     headers=bearer(admin_token)).status_code == 200
    assert [r.reported_by for r in store.rounds("mine")] == ["token:reporter-test"] * 2
    status_events = [(e.message, e.actor) for e in store.events("mine") if e.kind == "status"]
    assert status_events[0] == ("run is stopped", "token:admin-test")
    # A run that ended cannot be revived or re-finished through ingest.
    r = anon.post("/api/ingest/runs/mine/status", json={"status": "running"}, headers=bearer(owner))
    assert r.status_code == 409 and "no longer change" in r.json()["detail"]


def test_dashboard_started_run_only_its_process_or_an_admin(app, anon, admin):
    """A reporter token cannot finish, feed or steer a run the dashboard started."""
    rid = admin.post("/api/runs", json={"config": {"rounds": 40}}).json()["id"]
    reporter = make_token(app, "reporter")
    r = anon.post(f"/api/ingest/runs/{rid}/status", json={"status": "finished"}, headers=bearer(reporter))
    assert r.status_code == 403
    assert app.state.ctx.store.get_run(rid).status in ("pending", "running")
    admin.post(f"/api/runs/{rid}/stop?force=true")


def test_bound_token_nodes_belong_to_its_run(app, anon, admin):
    """Leaving run_id out of a heartbeat cannot move a node to another run."""
    store = app.state.ctx.store
    store.create_run({"rounds": 1}, run_id="r1")
    store.create_run({"rounds": 1}, run_id="r2")
    t1, t2 = make_token(app, "reporter", run_id="r1"), make_token(app, "reporter", run_id="r2")
    assert anon.post("/api/ingest/nodes", json={"node_id": "pi-1"}, headers=bearer(t1)).status_code == 200
    assert {n.id: n.run_id for n in store.list_nodes()}["pi-1"] == "r1"
    r = anon.post("/api/ingest/nodes", json={"node_id": "pi-1", "status": "failed"}, headers=bearer(t2))
    assert r.status_code == 403
    assert [(n.run_id, n.status) for n in store.list_nodes() if n.id == "pi-1"] == [("r1", "online")]
