"""Peers report heartbeats and rounds in the dashboard's ingest schema, and to a store."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.helpers import wait_until
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
    # linger_s: each peer waits (up to 60 s) until the other is done, so its last stats reach the reporter
    peers = make_peers(tmp_path, 2, rounds=3, report_url=url, token="tok-123", run_id="swarm-t1", linger_s=60.0)
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
    assert all(b["num_clients"] == len(b["nodes"]) for b in rounds)
    # every round waits for both peers' stats, however fast the rounds are against the gossip interval
    assert all(len(b["nodes"]) == 2 for b in rounds)
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


def _fake_peer(url: str, rounds: int = 6):
    """What :class:`~fedswarm.swarm.report.Recorder` reads of a peer, with a real membership
    table whose gossip the test feeds by hand: peer "a" (the reporter, lowest id) and "b"."""
    from types import SimpleNamespace

    from fedswarm.swarm.net.membership import Membership

    now = [0.0]
    cfg = SimpleNamespace(run_id="swarm-fake", report_url=url, token="t", db=None, algorithm="dpsgd", seed=0,
                          task="synthetic-logreg", rounds=rounds, partition="iid", topology="ring")
    m = Membership("a" * 8, "127.0.0.1:1", interval_s=1.0, suspect_after=1, remove_after=2, clock=lambda: now[0])
    peer = SimpleNamespace(id="a" * 8, cfg=cfg, membership=m, history=[], round=0,
                           transport=SimpleNamespace(address="127.0.0.1:1"),
                           verifier=SimpleNamespace(drop_counts=dict))
    return peer, now


def _gossip_b(peer, hb: int, rounds: list[int]) -> None:
    stats = [{"round": r, "train_loss": 0.5, "bytes_up": 10 * r} for r in rounds]
    peer.membership.merge([{"id": "b" * 8, "addr": "127.0.0.1:2", "inc": 1, "hb": hb, "info": {"stats": stats}}])


def _own_round(peer, rec, r: int) -> None:
    peer.round = r
    peer.history.append({"round": r, "train_loss": 0.25, "bytes_up": 1, "bytes_down": 2})
    rec.round_done(peer.history[-1])


def test_a_round_waits_for_the_gossiped_stats_of_every_member(ingest):
    """Gossip runs on its own clock: a round is posted once every member's stats for it reached
    the reporter (or the member moved past it), and stats collected before a member is removed
    still count."""
    from fedswarm.swarm.report import WAIT_ROUNDS, Recorder

    url, posts = ingest
    peer, now = _fake_peer(url)
    _gossip_b(peer, 1, [])
    rec = Recorder(peer)
    _own_round(peer, rec, 1)
    _own_round(peer, rec, 2)  # "b" has reported nothing yet: nothing posted
    _gossip_b(peer, 2, [1, 2, 3])  # "b" is a round ahead
    rec.tick()  # posts 1 and 2, and keeps b's round 3
    now[0] = 10.0
    assert [e for e, _ in peer.membership.check()] == ["removed"]
    _own_round(peer, rec, 3)  # "b" is gone, but its round 3 reached us before it went
    peer.membership.merge([{"id": "c" * 8, "addr": "127.0.0.1:3", "inc": 1, "hb": 1, "info": {}}])
    for r in range(4, 5 + WAIT_ROUNDS):  # "c" never reports: round 4 waits WAIT_ROUNDS of our rounds, no more
        _own_round(peer, rec, r)

    def rounds() -> dict[int, list[str]]:
        return {b["round"]: [n["node_id"][0] for n in b["nodes"]] for p, _, b in list(posts) if p.endswith("/rounds")}

    rec.heartbeat(force=True, telemetry={"train_s": 1.5})  # the queue is FIFO: once this beat is posted, so is
    wait_until(lambda: any(b.get("telemetry") for _, _, b in list(posts)), 30, interval=0.01,  # every round
               what="the heartbeat posted")                                                   # before it
    assert rounds() == {1: ["a", "b"], 2: ["a", "b"], 3: ["a", "b"], 4: ["a"]}
    rec.finish({})  # the rounds "c" holds back go with what they have
    assert rounds() == {**{r: ["a", "b"] for r in (1, 2, 3)}, **{r: ["a"] for r in range(4, 5 + WAIT_ROUNDS)}}
    order = [b["round"] for p, _, b in posts if p.endswith("/rounds")]
    assert order == sorted(order)
