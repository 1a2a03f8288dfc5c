"""Webhooks: a loopback receiver gets a correctly signed delivery for each event kind, a
failing receiver gets it on a later try, and a restarted dashboard sends nothing twice."""

from __future__ import annotations

import hashlib
import hmac
import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from fastapi.testclient import TestClient

from dashboard_helpers import ADMIN_PW, bearer, login, make_token, wait_for
from fedswarm.web.services.webhooks import EVENTS

FAST = dict(webhook_poll_s=0.05, webhook_backoff_s=0.05, webhook_timeout_s=5.0)
SECRET = "a-test-secret-of-some-length"


class Receiver:
    """A tiny HTTP server on 127.0.0.1 that records every POST and answers 500 to the first
    ``fail_first`` of them."""

    def __init__(self, fail_first: int = 0):
        self.posts: list[tuple[dict, bytes]] = []
        self.fail_first = fail_first
        self.cond = threading.Condition()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with outer.cond:
                    outer.posts.append(({k.lower(): v for k, v in self.headers.items()}, body))
                    code = 500 if len(outer.posts) <= outer.fail_first else 200
                    outer.cond.notify_all()
                self.send_response(code)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def wait(self, pred, timeout: float = 20.0) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: pred(self.posts), timeout), f"not received in {timeout} s: {self.posts}"

    def events(self) -> list[dict]:
        return [json.loads(b) for _, b in self.posts]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


def _signed(headers: dict, body: bytes, secret: str = SECRET) -> bool:
    want = "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(headers["x-fedswarm-signature"], want)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _register(client, url: str, events=EVENTS) -> dict:
    r = client.post("/api/webhooks", json={"url": url, "events": list(events), "secret": SECRET})
    assert r.status_code == 201, r.text
    return r.json()


def test_each_event_kind_is_delivered_signed_and_never_twice(make_app, receiver):
    app = make_app(**FAST)
    store = app.state.ctx.store
    with TestClient(app) as c:
        c.headers["X-CSRF-Token"] = login(c, "admin", ADMIN_PW)
        hook = _register(c, receiver.url)
        assert hook["secret"] == SECRET and hook["events"] == list(EVENTS)
        for rid, status in (("r-fin", "finished"), ("r-fail", "failed"), ("r-stop", "stopped")):
            store.create_run({}, run_id=rid, status="running")
            store.set_status(rid, status, error="boom" if status == "failed" else None)
        store.create_run({}, run_id="r-dp", status="running")
        store.add_event("r-dp", "privacy_budget", "epsilon 1.02 would pass the target 1.0")
        store.create_run({}, run_id="r-lost", status="running")
        store.update_run("r-lost", pid=_dead_pid())
        store.upsert_node("peer-1", kind="peer", status="offline", device_class="edge-wifi")
        store.upsert_node("sim-node", kind="sim", status="offline")  # simulated: no node.offline
        receiver.wait(lambda posts: len(posts) >= 6)
        got = {e["event"]: (e, h, b) for (h, b), e in zip(receiver.posts, receiver.events())}
        assert set(got) == set(EVENTS)
        for event, (_, headers, body) in got.items():
            assert _signed(headers, body), event
            assert headers["x-fedswarm-event"] == event and headers["content-type"] == "application/json"
        assert got["run.finished"][0]["run"]["id"] == "r-fin"
        assert got["run.failed"][0]["run"]["error"] == "boom"
        assert got["run.stopped"][0]["run"]["id"] == "r-stop"
        dp = got["run.privacy_budget"][0]
        assert dp["run"]["id"] == "r-dp" and "epsilon" in dp["message"]
        assert got["run.lost"][0]["run"]["display_status"] == "lost"
        assert got["node.offline"][0]["node"]["id"] == "peer-1"
        log = f"/api/webhooks/{hook['id']}/deliveries"
        wait_for(lambda: all(d["status"] == "delivered" for d in c.get(log).json()))
        page = c.get("/admin").text
        assert receiver.url in page and "delivered" in page and "run.privacy_budget" in page
    # A restarted dashboard over the same store: the old events are not sent again.
    before = len(receiver.posts)
    app2 = make_app(**FAST)
    with TestClient(app2):
        app2.state.ctx.store.create_run({}, run_id="r-after", status="running")
        app2.state.ctx.store.set_status("r-after", "finished")
        receiver.wait(lambda posts: len(posts) > before)
        wait_for(lambda: app2.state.webhooks.scan() == 0)  # a scan with nothing new to queue
    assert len(receiver.posts) == before + 1
    assert receiver.events()[-1]["run"]["id"] == "r-after"
    ids = [h["x-fedswarm-delivery"] for h, _ in receiver.posts]
    assert len(ids) == len(set(ids))


def test_a_failing_receiver_gets_it_on_the_third_try(make_app):
    rec = Receiver(fail_first=2)
    app = make_app(**FAST)
    try:
        with TestClient(app) as c:
            c.headers["X-CSRF-Token"] = login(c, "admin", ADMIN_PW)
            hook = _register(c, rec.url, ["run.finished"])
            store = app.state.ctx.store
            store.create_run({}, run_id="r1", status="running")
            store.set_status("r1", "finished")
            rec.wait(lambda posts: len(posts) >= 3)
            wait_for(lambda: c.get(f"/api/webhooks/{hook['id']}/deliveries").json()[0]["status"] == "delivered")
            (d,) = c.get(f"/api/webhooks/{hook['id']}/deliveries").json()
            assert d["attempts"] == 3 and d["last_code"] == 200 and d["last_error"] is None
        assert len(rec.posts) == 3
        assert len({h["x-fedswarm-delivery"] for h, _ in rec.posts}) == 1  # the same delivery, retried
        assert all(_signed(h, b) for h, b in rec.posts)
    finally:
        rec.close()


def test_gives_up_after_its_attempts(make_app):
    rec = Receiver(fail_first=100)
    app = make_app(**FAST, webhook_attempts=2)
    try:
        with TestClient(app) as c:
            c.headers["X-CSRF-Token"] = login(c, "admin", ADMIN_PW)
            hook = _register(c, rec.url, ["run.stopped"])
            app.state.ctx.store.create_run({}, run_id="r1", status="running")
            app.state.ctx.store.set_status("r1", "stopped")
            wait_for(lambda: (c.get(f"/api/webhooks/{hook['id']}/deliveries").json() or [{}])[0].get("status")
                     == "failed")
            (d,) = c.get(f"/api/webhooks/{hook['id']}/deliveries").json()
            assert d["attempts"] == 2 and d["last_code"] == 500 and "500" in d["last_error"]
    finally:
        rec.close()


def test_webhook_api_validation_and_roles(app, admin, viewer):
    r = admin.post("/api/webhooks", json={"url": "ftp://example.com/x", "events": ["run.finished"]})
    assert r.status_code == 422 and "http:// or https://" in json.dumps(r.json())
    r = admin.post("/api/webhooks", json={"url": "https://example.com/x", "events": ["run.exploded"]})
    assert r.status_code == 422
    r = admin.post("/api/webhooks", json={"url": "https://example.com/x", "events": []})
    assert r.status_code == 422
    created = admin.post("/api/webhooks", json={"url": "https://example.com/x",
                                                "events": ["node.offline", "run.lost", "run.lost"]}).json()
    assert created["events"] == ["run.lost", "node.offline"] and len(created["secret"]) >= 32
    listed = admin.get("/api/webhooks").json()
    assert [w["id"] for w in listed] == [created["id"]] and "secret" not in listed[0]
    assert viewer.get("/api/webhooks").status_code == 403
    assert admin.get("/api/webhooks", headers=bearer(make_token(app, "viewer"))).status_code == 403
    r = admin.patch(f"/api/webhooks/{created['id']}", json={"enabled": False})
    assert r.status_code == 200 and r.json()["enabled"] is False
    assert admin.delete(f"/api/webhooks/{created['id']}").status_code == 200
    assert admin.get(f"/api/webhooks/{created['id']}").status_code == 404


def test_admin_page_adds_and_deletes_a_webhook(admin, app):
    csrf = admin.headers["X-CSRF-Token"]
    r = admin.post("/admin/webhooks", data={"csrf_token": csrf, "url": "https://hooks.example.com/a",
                                            "event_run.finished": "1", "event_node.offline": "1"})
    assert r.status_code == 200 and "hooks.example.com/a" in r.text and 'id="new-webhook"' in r.text
    (hook,) = admin.get("/api/webhooks").json()
    assert hook["events"] == ["run.finished", "node.offline"]
    r = admin.post("/admin/webhooks", data={"csrf_token": csrf, "url": "file:///etc/passwd",
                                            "event_run.finished": "1"}, follow_redirects=True)
    assert "http:// or https://" in r.text
    admin.post(f"/admin/webhooks/{hook['id']}/delete", data={"csrf_token": csrf})
    assert admin.get("/api/webhooks").json() == []
