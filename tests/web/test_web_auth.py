"""Auth: no session or token changes nothing; viewers cannot start or stop; CSRF is enforced;
tokens are stored hashed; sessions are signed and end at logout."""

from __future__ import annotations

from fastapi.testclient import TestClient
from sqlalchemy import select, text

from fedswarm.web.tables import ApiToken, User
from dashboard_helpers import ADMIN_PW, bearer, login, make_token

WRITES = [
    ("post", "/api/runs", {"config": {"rounds": 2}}),
    ("post", "/api/runs/{rid}/pause", None),
    ("post", "/api/runs/{rid}/resume", None),
    ("post", "/api/runs/{rid}/stop", None),
    ("post", "/api/runs/{rid}/add_rounds", {"rounds": 3}),
    ("post", "/api/policies", {"run_id": "{rid}", "device_class": "edge", "policy": {"local_steps": 2}}),
    ("post", "/api/tokens", {"name": "x", "role": "admin"}),
    ("post", "/api/users", {"username": "mallory", "password": "longenough1", "role": "admin"}),
]


def _snapshot(app) -> tuple:
    store = app.state.ctx.store
    with store.session() as s:
        counts = tuple(s.execute(text(f"SELECT count(*) FROM {t}")).scalar()
                       for t in ("runs", "controls", "events", "web_users", "web_api_tokens"))
    return counts, tuple((r.id, r.status, r.total_rounds) for r in store.list_runs())


def _fill(path: str, body, rid: str):
    path = path.replace("{rid}", rid)
    if isinstance(body, dict):
        body = {k: (v.replace("{rid}", rid) if isinstance(v, str) else v) for k, v in body.items()}
    return path, body


def _seed_run(app) -> str:
    store = app.state.ctx.store
    rid = store.create_run({"rounds": 5, "strategy": "fedavg"}, status="running")
    return rid


def test_anonymous_request_changes_nothing(app, anon):
    rid = _seed_run(app)
    before = _snapshot(app)
    for method, path, body in WRITES:
        path, body = _fill(path, body, rid)
        r = getattr(anon, method)(path, json=body) if body is not None else getattr(anon, method)(path)
        assert r.status_code == 401, (path, r.status_code, r.text)
        assert "Bearer" in r.headers.get("www-authenticate", "")
    for path in ("/api/runs", f"/api/runs/{rid}", f"/api/runs/{rid}/rounds", "/api/nodes", "/api/tokens"):
        assert anon.get(path).status_code == 401
    assert _snapshot(app) == before


def test_bad_or_revoked_token_changes_nothing(app, anon):
    rid = _seed_run(app)
    token = make_token(app, "admin")
    tid = int(token.split("_")[1])
    app.state.ctx.accounts.revoke_token(tid)
    before = _snapshot(app)
    for bad in (token, token[:-2] + "xx", "fst_1_nope", "garbage", ""):
        r = anon.post(f"/api/runs/{rid}/stop", headers=bearer(bad))
        assert r.status_code == 401
    r = anon.post(f"/api/runs/{rid}/stop", headers={"Authorization": "Basic YWRtaW46eA=="})
    assert r.status_code == 401
    assert _snapshot(app) == before


def test_viewer_cannot_start_or_stop(app, viewer):
    rid = _seed_run(app)
    before = _snapshot(app)
    for method, path, body in WRITES:
        path, body = _fill(path, body, rid)
        r = getattr(viewer, method)(path, json=body) if body is not None else getattr(viewer, method)(path)
        assert r.status_code == 403, (path, r.status_code, r.text)
        assert "admin role" in r.json()["detail"]
    csrf = viewer.headers["X-CSRF-Token"]
    r = viewer.post("/runs/new", data={"csrf_token": csrf, "rounds": "2"}, follow_redirects=False)
    assert r.status_code == 403
    r = viewer.post(f"/runs/{rid}/control", data={"csrf_token": csrf, "action": "stop"}, follow_redirects=False)
    assert r.status_code == 403
    assert _snapshot(app) == before
    # ...but a viewer sees everything.
    assert viewer.get("/api/runs").status_code == 200
    assert viewer.get(f"/runs/{rid}").status_code == 200
    assert "Pause" not in viewer.get(f"/runs/{rid}").text
    assert viewer.get("/admin").status_code == 403


def test_viewer_and_reporter_tokens(app, anon):
    rid = _seed_run(app)
    before = _snapshot(app)
    viewer_token, reporter_token = make_token(app, "viewer"), make_token(app, "reporter")
    assert anon.get("/api/runs", headers=bearer(viewer_token)).status_code == 200
    assert anon.post(f"/api/runs/{rid}/stop", headers=bearer(viewer_token)).status_code == 403
    assert anon.get("/api/runs", headers=bearer(reporter_token)).status_code == 403
    assert anon.post(f"/api/runs/{rid}/stop", headers=bearer(reporter_token)).status_code == 403
    assert anon.post("/api/ingest/nodes", json={"node_id": "p1"}, headers=bearer(viewer_token)).status_code == 403
    after = _snapshot(app)
    assert after[1] == before[1] and after[0][:2] == before[0][:2]


def test_csrf_required_for_cookie_writes(app, admin):
    rid = _seed_run(app)
    csrf = admin.headers.pop("X-CSRF-Token")
    before = _snapshot(app)
    assert admin.post(f"/api/runs/{rid}/stop").status_code == 403
    assert admin.post(f"/api/runs/{rid}/stop", headers={"X-CSRF-Token": "wrong"}).status_code == 403
    r = admin.post(f"/runs/{rid}/control", data={"action": "stop"}, follow_redirects=False)
    assert r.status_code == 403
    r = admin.post(f"/runs/{rid}/control", data={"action": "stop", "csrf_token": "x" + csrf},
                   follow_redirects=False)
    assert r.status_code == 403
    r = admin.post("/runs/new", json={"rounds": 2, "csrf_token": csrf})  # forms only
    assert r.status_code in (403, 415)
    assert _snapshot(app) == before
    r = admin.post(f"/runs/{rid}/control", data={"action": "stop", "csrf_token": csrf}, follow_redirects=False)
    assert r.status_code == 303
    assert admin.post(f"/api/runs/{rid}/pause", headers={"X-CSRF-Token": csrf}).status_code == 200


def test_safe_methods_never_need_the_csrf_header(app, admin):
    """An admin's cookie-authenticated GET, HEAD or OPTIONS of an admin-only route needs no
    X-CSRF-Token (it changes nothing); a write to the same route still does."""
    admin.headers.pop("X-CSRF-Token")
    for path in ("/api/webhooks", "/api/users", "/api/tokens"):
        assert admin.get(path).status_code == 200, path
        assert admin.head(path).status_code in (200, 405), path  # 405: no HEAD route, never a CSRF 403
        assert admin.options(path).status_code in (200, 405), path
    r = admin.post("/api/webhooks", json={"url": "http://127.0.0.1:9/h", "events": ["run.failed"]})
    assert r.status_code == 403 and "X-CSRF-Token" in r.json()["detail"]


def test_login_form_needs_its_csrf_cookie_and_right_password(app):
    c = TestClient(app)
    r = c.post("/login", data={"username": "admin", "password": ADMIN_PW, "csrf_token": "forged"})
    assert r.status_code == 403 and "fedswarm_session" not in c.cookies
    page = c.get("/login")
    import re
    tok = re.search(r'name="csrf_token" value="([^"]+)"', page.text).group(1)
    r = c.post("/login", data={"username": "admin", "password": "wrong-password", "csrf_token": tok})
    assert r.status_code == 401 and "wrong username or password" in r.text
    assert "fedswarm_session" not in c.cookies


def test_open_redirect_blocked(app):
    c = TestClient(app)
    page = c.get("/login?next=//evil.example/x")
    assert 'value="/runs"' in page.text


def test_session_cookie_is_signed_and_ends_at_logout(app, admin):
    cookie = admin.cookies["fedswarm_session"]
    assert admin.get("/api/whoami").json()["role"] == "admin"
    other = TestClient(app)
    other.cookies.set("fedswarm_session", cookie[:-3] + "abc")
    assert other.get("/api/whoami").status_code == 401
    sid = cookie.rsplit(".", 1)[0]
    other.cookies.set("fedswarm_session", sid + ".forged")
    assert other.get("/api/whoami").status_code == 401
    r = admin.post("/logout", data={"csrf_token": admin.headers["X-CSRF-Token"]}, follow_redirects=False)
    assert r.status_code == 303
    replay = TestClient(app)
    replay.cookies.set("fedswarm_session", cookie)
    assert replay.get("/api/whoami").status_code == 401


def test_tokens_and_passwords_are_stored_hashed(app, admin):
    r = admin.post("/api/tokens", json={"name": "peer-1", "role": "reporter"})
    assert r.status_code == 201
    token = r.json()["token"]
    secret = token.split("_", 2)[2]
    with app.state.ctx.store.session() as s:
        rows = list(s.scalars(select(ApiToken)))
        users = list(s.scalars(select(User)))
    assert all(secret not in row.token_hash and token not in row.token_hash for row in rows)
    assert all(ADMIN_PW not in u.password_hash and u.password_hash.startswith("scrypt$") for u in users)
    listed = admin.get("/api/tokens").json()
    assert "token" not in listed[0] and listed[0]["name"] == "peer-1"
    assert admin.get("/api/whoami", headers=bearer(token)).status_code == 403  # reporter: no reads


def test_admin_created_once_with_generated_password(tmp_path, monkeypatch):
    from fedswarm.web.app import create_app

    monkeypatch.delenv("FEDSWARM_ADMIN_PASSWORD", raising=False)
    said: list[str] = []
    db = str(tmp_path / "first.db")
    app = create_app(db, announce=said.append, catalog_cmd=["false"])
    assert len(said) == 1 and "admin" in said[0]
    password = said[0].split("password ")[1].split(" ")[0]
    c = TestClient(app)
    login(c, "admin", password)
    create_app(db, announce=said.append, catalog_cmd=["false"])
    assert len(said) == 1  # not again


def test_admin_password_from_environment(tmp_path, monkeypatch):
    from fedswarm.web.app import create_app

    monkeypatch.setenv("FEDSWARM_ADMIN_PASSWORD", "from-the-env-1")
    said: list[str] = []
    app = create_app(str(tmp_path / "env.db"), announce=said.append, catalog_cmd=["false"])
    assert said == []
    login(TestClient(app), "admin", "from-the-env-1")


def test_login_throttled_after_many_failures(app):
    import re

    c = TestClient(app)
    for _ in range(10):
        tok = re.search(r'name="csrf_token" value="([^"]+)"', c.get("/login").text).group(1)
        c.post("/login", data={"username": "admin", "password": "nope-nope", "csrf_token": tok})
    tok = re.search(r'name="csrf_token" value="([^"]+)"', c.get("/login").text).group(1)
    r = c.post("/login", data={"username": "admin", "password": ADMIN_PW, "csrf_token": tok})
    assert r.status_code == 429
