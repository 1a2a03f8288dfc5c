"""Helpers shared by the dashboard tests (imported by conftest.py and the test modules)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
from fastapi.testclient import TestClient

from tests.helpers import free_port, wait_until  # noqa: F401  (free_port: used by the test modules)

HERE = Path(__file__).resolve().parent
ADMIN_PW = "admin-password-1"
VIEWER_PW = "viewer-password-1"
FAKE_RUNNER = [sys.executable, str(HERE / "fake_runner.py")]
FAKE_CATALOG = [sys.executable, str(HERE / "fake_catalog.py")]




def login(client: TestClient, username: str, password: str) -> str:
    """Log in through the form; returns the session's CSRF token."""
    page = client.get("/login")
    token = re.search(r'name="csrf_token" value="([^"]+)"', page.text).group(1)
    r = client.post("/login", data={"username": username, "password": password, "csrf_token": token,
                                    "next": "/runs"}, follow_redirects=False)
    assert r.status_code == 303, r.text
    page = client.get("/runs")
    return re.search(r'name="csrf-token" content="([^"]+)"', page.text).group(1)


def make_token(app, role: str, run_id: str | None = None) -> str:
    _, token = app.state.ctx.accounts.create_token(f"{role}-test", role, run_id, "test")
    return token


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def wait_for(pred, timeout: float = 60.0, interval: float = 0.05):
    return wait_until(pred, timeout, interval=interval)


class Server:
    """A dashboard served by uvicorn in its own process."""

    def __init__(self, proc: subprocess.Popen, port: int, db: Path, log: Path):
        self.proc, self.port, self.db, self.log = proc, port, db, log
        self.url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def start_server(tmp_path: Path, fake: bool, poll: float = 0.3, env: dict | None = None,
                 report_timeout_s: float | None = None, args: list[str] | None = None) -> Server:
    port, db, log = free_port(), tmp_path / "server.db", tmp_path / "server.log"
    cmd = [sys.executable, str(HERE / "serve.py"), "--db", str(db), "--port", str(port), "--poll", str(poll),
           "--admin-password", ADMIN_PW] + (["--fake"] if fake else []) + list(args or [])
    if report_timeout_s is not None:
        cmd += ["--report-timeout", str(report_timeout_s)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    server = Server(proc, port, db, log)
    try:
        wait_for(lambda: _up(server), timeout=90, interval=0.2)
    except AssertionError:
        server.stop()
        raise AssertionError("dashboard did not start:\n" + log.read_text()[-3000:]) from None
    return server


def _up(server: Server) -> bool:
    if server.proc.poll() is not None:
        raise AssertionError("dashboard exited:\n" + server.log.read_text()[-3000:])
    try:
        return httpx.get(server.url + "/api/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def kill_runs(store) -> None:
    """Kill any run process a test left behind (each run has its own process group)."""
    for run in store.list_runs():
        if run.pid:
            try:
                os.killpg(run.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


CHROMIUM = os.environ.get("FEDSWARM_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]


def chromium_or_skip():
    """Playwright's sync API and Debian's Chromium path for a browser test module; skips the
    module, saying what to install, when either is missing."""
    import shutil

    import pytest

    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    path = CHROMIUM if os.path.exists(CHROMIUM) else shutil.which("chromium")
    if not path:
        pytest.skip(f"Chromium missing at {CHROMIUM}: apt-get install -y chromium", allow_module_level=True)
    return sync_api, path
