"""Peers report heartbeats and rounds in the dashboard's ingest schema, and to a store."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.swarm_helpers import make_peers, run_all


class _Ingest(BaseHTTPRequestHandler):
    posts: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.posts.append((self.path, self.headers.get("Authorization"), body))
        dup = self.path.endswith("/rounds") and sum(p[0] == self.path and p[2]["round"] == body["round"]
                                                    for p in self.posts) > 1
        self.send_response(409 if dup else 201)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"ok": true}')

    def log_message(self, *args):
        pass


@pytest.fixture
def ingest():
    _Ingest.posts = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Ingest)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", _Ingest.posts
    server.shutdown()
    server.server_close()


def test_peers_report_in_the_ingest_schema(tmp_path, ingest):
    import fedswarm.web.routers.api.ingest as api
    url, posts = ingest
    peers = make_peers(tmp_path, 2, rounds=3, report_url=url, token="tok-123", run_id="swarm-t1")
    run_all(peers)
    assert posts and all(auth == "Bearer tok-123" for _, auth, _ in posts)
    models = {"/api/ingest/runs": api.RunIn, "/api/ingest/nodes": api.NodeIn,
              "/api/ingest/runs/swarm-t1/rounds": api.RoundIn, "/api/ingest/runs/swarm-t1/status": api.StatusIn}
    for path, _, body in posts:
        models[path].model_validate(body)  # exactly the dashboard's schema (extra keys forbidden)
    beats = [b for p, _, b in posts if p.endswith("/nodes")]
    assert {b["node_id"] for b in beats} == {p.id for p in peers}
    rounds = [b for p, _, b in posts if p.endswith("/rounds")]
    assert sorted({b["round"] for b in rounds}) == [1, 2, 3]
    assert all(len(b["nodes"]) >= 1 and b["num_clients"] == len(b["nodes"]) for b in rounds)
    assert any(len(b["nodes"]) == 2 for b in rounds)
    assert any(p.endswith("/status") and b["status"] == "finished" for p, _, b in posts)


def test_peers_record_into_a_store(tmp_path):
    from fedswarm.store import Store

    db = tmp_path / "store.db"
    peers = make_peers(tmp_path, 2, rounds=3, db=str(db), run_id="swarm-db")
    run_all(peers)
    store = Store(db)
    try:
        run = store.get_run("swarm-db")
        assert run is not None and run.status == "finished" and run.engine == "swarm"
        assert [r.round for r in store.rounds("swarm-db")] == [1, 2, 3]
        assert {n.id for n in store.list_nodes("swarm-db")} == {p.id for p in peers}
        assert store.node_rounds("swarm-db")
    finally:
        store.close()
