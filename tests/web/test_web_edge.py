"""The dashboard's hot path (issue 49): no access line per request unless asked, one middleware
wrapping ``send``, and cache entries rebuilt ahead of their expiry."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path

from dashboard_helpers import ADMIN_PW, Server, _up, wait_for
from fastapi.testclient import TestClient
from starlette.middleware.errors import ServerErrorMiddleware
from starlette.middleware.exceptions import ExceptionMiddleware

from fedswarm.web.cache import Answer, ResponseCache
from fedswarm.web.middleware import Edge
from tests.helpers import free_port


def _dashboard(tmp_path: Path, name: str, *args: str) -> Server:
    """``fedswarm dashboard`` itself (the command, not a test server script), output to a file."""
    port, log = free_port(), tmp_path / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "fedswarm", "dashboard", "--db", str(tmp_path / "store.db"),
                                 "--port", str(port), *args], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "FEDSWARM_ADMIN_PASSWORD": ADMIN_PW})
    server = Server(proc, port, tmp_path / "store.db", log)
    try:
        wait_for(lambda: _up(server), timeout=90, interval=0.2)
    except BaseException:
        server.stop()
        raise
    return server


def _bad_request(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        s.recv(1024)


def test_dashboard_logs_no_line_per_request_unless_asked_and_still_logs_errors(tmp_path):
    quiet = _dashboard(tmp_path, "quiet")
    try:
        import httpx

        for _ in range(3):
            assert httpx.get(quiet.url + "/api/health", timeout=10).status_code == 200
        _bad_request(quiet.port)
    finally:
        quiet.stop()
    out = quiet.log.read_text()
    assert "GET /api/health" not in out, out[-2000:]
    assert "Invalid HTTP request" in out, out[-2000:]  # uvicorn's error log is still on

    loud = _dashboard(tmp_path, "loud", "--access-log")
    try:
        import httpx

        assert httpx.get(loud.url + "/api/health", timeout=10).status_code == 200
    finally:
        loud.stop()
    assert '"GET /api/health HTTP/1.1" 200' in loud.log.read_text()


def test_one_middleware_wraps_the_app_between_starlettes_own(app):
    with TestClient(app) as c:
        assert c.get("/api/health").status_code == 200  # builds the middleware stack
    stack, layers = app.middleware_stack, []
    while stack is not None and not isinstance(stack, ExceptionMiddleware):
        layers.append(type(stack))
        stack = getattr(stack, "app", None)
    assert layers == [ServerErrorMiddleware, Edge]


def test_an_entry_is_rebuilt_in_the_background_before_it_expires(app):
    store = app.state.ctx.store
    cache = ResponseCache(store, ttl_s=30, mark_s=60, max_stale_s=30, ahead_s=10)
    built: list[int] = []

    def build() -> Answer:
        built.append(len(built))
        return Answer(str(len(built)).encode())

    assert cache.get(("k",), build) == Answer(b"1")
    assert cache.lookup(("k",)) == (Answer(b"1"), False)  # 30 s to go: fresh, no refresh
    entry = cache._entries[("k",)]
    cache._entries[("k",)] = entry.__class__(entry.expires - 25, entry.mark, entry.built_at, entry.value, entry.build)
    assert cache.lookup(("k",)) == (Answer(b"1"), True)  # 5 s to go: served, and refreshed ahead

    async def refresh():
        await asyncio.wait_for(cache.refresh_soon(("k",)), 30)

    asyncio.run(refresh())
    assert built == [0, 1] and cache.lookup(("k",)) == (Answer(b"2"), False)
