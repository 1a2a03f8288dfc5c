"""Fixtures for the dashboard tests: an app over a temp SQLite store with a fake runner and
catalog, logged-in clients of each role, and a real uvicorn server process."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from dashboard_helpers import (ADMIN_PW, FAKE_CATALOG, FAKE_RUNNER, VIEWER_PW, kill_runs, login,
                               start_server)
from fedswarm.web.app import create_app


@pytest.fixture
def make_app(tmp_path):
    def make(**kw):
        kw.setdefault("admin_password", ADMIN_PW)
        kw.setdefault("runner", FAKE_RUNNER)
        kw.setdefault("catalog_cmd", FAKE_CATALOG)
        kw.setdefault("poll_interval_s", 0.1)
        return create_app(str(tmp_path / "store.db"), **kw)
    return make


@pytest.fixture
def app(make_app, monkeypatch):
    monkeypatch.setenv("FAKE_ROUND_S", "0.05")
    app = make_app()
    yield app
    kill_runs(app.state.ctx.store)


@pytest.fixture
def anon(app):
    with TestClient(app) as c:
        yield c


@pytest.fixture
def admin(app):
    """A client logged in as admin, sending its CSRF token."""
    with TestClient(app) as c:
        c.headers["X-CSRF-Token"] = login(c, "admin", ADMIN_PW)
        yield c


@pytest.fixture
def viewer(app):
    app.state.ctx.accounts.create_user("viewer", VIEWER_PW, "viewer")
    c = TestClient(app)
    c.headers["X-CSRF-Token"] = login(c, "viewer", VIEWER_PW)
    yield c
    c.close()


@pytest.fixture
def fake_server(tmp_path):
    """A real uvicorn dashboard process whose runs are fake (0.3 s a round)."""
    server = start_server(tmp_path, fake=True, poll=0.1, env={"FAKE_ROUND_S": "0.3"})
    yield server
    server.stop()
