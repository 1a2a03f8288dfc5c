"""Limits before work: oversized and anonymous bodies refused before they are read (against a
real uvicorn process, measuring its memory), per-token ingest quotas, and the login throttle
(per address and per name, without letting a stranger lock a user out)."""

from __future__ import annotations

import re
import socket
import threading
import time
from pathlib import Path

from fastapi.testclient import TestClient

from dashboard_helpers import ADMIN_PW, bearer, make_token, start_server


def _rss_kb(pid: int, field: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for pid {pid}")


def _chunked_post(port: int, path: str, total_bytes: int, headers: str = "") -> tuple[str, float, int]:
    """POST ``total_bytes`` in 1 MB chunks while reading the answer; returns (status line,
    seconds until it arrived, bytes sent by then)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=20)
    sock.sendall((f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{headers}"
                  "Transfer-Encoding: chunked\r\n\r\n").encode())
    chunk = b"%x\r\n" % (1 << 20) + b"{" * (1 << 20) + b"\r\n"
    sent, answer, done = 0, bytearray(), threading.Event()

    def read() -> None:
        try:
            while b"\r\n" not in answer:
                data = sock.recv(4096)
                if not data:
                    break
                answer.extend(data)
        except OSError:
            pass
        done.set()

    reader = threading.Thread(target=read, daemon=True)
    t0 = time.monotonic()
    reader.start()
    try:
        while sent < total_bytes and not done.is_set():
            sock.sendall(chunk)
            sent += 1 << 20
    except OSError:
        pass  # the server closed the connection after answering: what we want
    done.wait(20)
    elapsed = time.monotonic() - t0
    sock.close()
    return bytes(answer).split(b"\r\n", 1)[0].decode(), elapsed, sent


def test_300mb_anonymous_chunked_post_refused_fast_with_bounded_memory(tmp_path):
    server = start_server(tmp_path, fake=True)
    try:
        rss0 = _rss_kb(server.proc.pid)
        for path in ("/api/ingest/runs/x1/rounds", "/api/ingest/nodes", "/api/runs"):
            status, elapsed, sent = _chunked_post(server.port, path, 300 << 20)
            assert status.startswith("HTTP/1.1 401"), status
            assert elapsed < 1.0, (path, elapsed)
        # With a (bogus) token the body is read, but only up to the route's cap.
        status, elapsed, sent = _chunked_post(server.port, "/api/ingest/runs/x1/rounds", 300 << 20,
                                              "Authorization: Bearer fst_1_nope\r\n")
        assert status.startswith("HTTP/1.1 413"), status
        assert elapsed < 1.0 and sent < 50 << 20, (elapsed, sent)
        peak = _rss_kb(server.proc.pid, "VmHWM")  # the process's peak resident memory so far
        assert peak - rss0 < 20 * 1024, f"RSS grew by {(peak - rss0) / 1024:.1f} MB"
        assert _health(server.url)
    finally:
        server.stop()


def _health(url: str) -> bool:
    import httpx

    return httpx.get(url + "/api/health", timeout=5).status_code == 200


def test_declared_length_over_the_route_cap_is_413_naming_it(app, anon):
    h = bearer(make_token(app, "reporter"))
    r = anon.post("/api/ingest/runs/x/status", content=b"{" + b" " * 9000 + b"}",
                  headers={**h, "content-type": "application/json"})
    assert r.status_code == 413 and "8192" in r.json()["detail"]
    assert anon.post("/api/runs", json={"config": {}}).status_code == 401  # anonymous write


def test_ingest_quota_per_token(make_app, anon):
    app = make_app(ingest_per_minute=5)
    with TestClient(app) as c:
        a, b = bearer(make_token(app, "reporter")), bearer(make_token(app, "reporter"))
        codes = [c.post("/api/ingest/nodes", json={"node_id": f"n{i}"}, headers=a).status_code for i in range(7)]
        assert codes == [200] * 5 + [429] * 2
        r = c.post("/api/ingest/nodes", json={"node_id": "z"}, headers=a)
        assert int(r.headers["retry-after"]) >= 1 and "5 ingest requests" in r.json()["detail"]
        assert c.post("/api/ingest/nodes", json={"node_id": "other"}, headers=b).status_code == 200
    app2 = make_app(ingest_bytes_per_hour=2000)
    with TestClient(app2) as c:
        h = bearer(make_token(app2, "reporter"))
        body = {"node_id": "n", "info": {"x": "y" * 600}}
        codes = [c.post("/api/ingest/nodes", json=body, headers=h).status_code for _ in range(4)]
        assert codes[:3] == [200, 200, 200] and codes[3] == 429


def test_node_quota_per_token(make_app):
    app = make_app(nodes_per_token=3)
    with TestClient(app) as c:
        h = bearer(make_token(app, "reporter"))
        codes = [c.post("/api/ingest/nodes", json={"node_id": f"n{i}"}, headers=h).status_code for i in range(4)]
        assert codes == [200, 200, 200, 429]
        assert c.post("/api/ingest/nodes", json={"node_id": "n0"}, headers=h).status_code == 200  # heartbeat


def _try_login(client: TestClient, username: str, password: str, address: str | None = None) -> int:
    page = client.get("/login")
    token = re.search(r'name="csrf_token" value="([^"]+)"', page.text).group(1)
    r = client.post("/login", data={"username": username, "password": password, "csrf_token": token,
                                    "next": "/runs"}, follow_redirects=False)
    return r.status_code


def test_login_throttle_per_address_and_name_without_lockout(app):
    throttle = app.state.ctx.throttle
    # A stranger guessing admin's password from many addresses hits the per-name limit...
    for i in range(throttle.name.amount):
        throttle.failed(f"10.0.0.{i}", "admin")
    with TestClient(app, client=("10.9.9.9", 5000)) as stranger:
        assert _try_login(stranger, "admin", ADMIN_PW) == 429
    # ...but the admin's own browser, which logged in before, still gets in.
    with TestClient(app, client=("10.1.1.1", 5000)) as own:
        throttle.limiter.storage.reset()
        assert _try_login(own, "admin", ADMIN_PW) == 303  # sets the known-device cookie
        own.cookies.delete("fedswarm_session")  # logged out; the browser keeps knowing the user
        for i in range(throttle.name.amount):
            throttle.failed(f"10.0.0.{i}", "admin")
        assert _try_login(own, "admin", ADMIN_PW) == 303
    # Spraying many names from one address is slowed too.
    throttle.limiter.storage.reset()
    with TestClient(app, client=("10.2.2.2", 5000)) as sprayer:
        codes = [_try_login(sprayer, f"user{i}", "wrong-password") for i in range(throttle.address.amount + 1)]
        assert codes[:-1] == [401] * throttle.address.amount and codes[-1] == 429
    with TestClient(app, client=("10.3.3.3", 5000)) as other:
        assert _try_login(other, "admin", ADMIN_PW) == 303  # another address is not affected
