"""Report a peer's heartbeats and rounds to a dashboard (``--report URL --token``) and/or a
run store (``--db``), without ever blocking training.

Schema: ``web/routers/api/ingest.py`` (``RunIn``, ``NodeIn``, ``RoundIn`` with
``NodeRoundIn`` rows), authenticated with ``Authorization: Bearer TOKEN``. Every peer
posts its own node heartbeat; a round row is unique per run, so only the *reporter* (the
lowest live peer id) posts rounds, with a node row for every peer whose stats reached it by
gossip (each peer's membership entry carries its last three rounds). Gossip runs on its own
clock (``--heartbeat-s``), not the rounds', so every peer keeps the stats rows it has seen
(collected on each heartbeat tick, before failure detection can remove their sender), and
round r is posted once every member has reported r or moved past it; a member still silent
when the reporter is ``WAIT_ROUNDS`` rounds ahead is left out, and the peer's finish posts
whatever is left. If the reporter dies the next lowest id takes over; a round posted twice
gets 409, which is ignored. HTTP requests go through a bounded queue and one background
thread.
"""

from __future__ import annotations

import json
import logging
import math
import queue
import threading
import time
import urllib.error
import urllib.request
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedswarm.swarm.peer import Peer

__all__ = ["WAIT_ROUNDS", "Recorder", "round_payload"]

log = logging.getLogger("fedswarm.swarm")

WAIT_ROUNDS = 3  # a round waits at most this many of the reporter's rounds for a silent member's stats


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def round_payload(r: int, stats: dict[str, dict]) -> dict:
    """A ``RoundIn`` body for round ``r`` from ``{peer_id: stats row of round r}``."""
    losses = [x for s in stats.values() if (x := _num(s.get("train_loss"))) is not None]
    accs = [x for s in stats.values() if (x := _num(s.get("test_accuracy"))) is not None]
    nodes = [{"node_id": pid, "bytes_up": int(s.get("bytes_up") or 0), "bytes_down": int(s.get("bytes_down") or 0),
              "train_loss": _num(s.get("train_loss")), "status": "ok"} for pid, s in sorted(stats.items())]
    return {
        "round": r,
        "train_loss": sum(losses) / len(losses) if losses else None,
        "test_accuracy": min(1.0, max(0.0, sum(accs) / len(accs))) if accs else None,
        "bytes_up": sum(n["bytes_up"] for n in nodes),
        "bytes_down": sum(n["bytes_down"] for n in nodes),
        "num_clients": len(nodes),
        "metrics": {"accuracy_is": "mean over peers of their own model's accuracy"},
        "nodes": nodes,
    }


def _open_store(db: str):
    """The store; peers sharing one SQLite file may race to create its tables."""
    from sqlalchemy.exc import OperationalError

    from fedswarm.store import Store

    for attempt in range(5):
        try:
            return Store(db)
        except OperationalError:
            if attempt == 4:
                raise
            time.sleep(0.1 * (attempt + 1))


class Recorder:
    def __init__(self, peer: Peer, *, min_interval_s: float = 2.0):
        self.peer = peer
        cfg = peer.cfg
        self.run_id = cfg.run_id or f"swarm-{cfg.algorithm}-{cfg.seed}"[:36]
        self.url = cfg.report_url.rstrip("/") if cfg.report_url else None
        self.token = cfg.token
        self.store = _open_store(cfg.db) if cfg.db else None
        self.min_interval_s = min_interval_s
        self._last_beat = 0.0
        self._seen: dict[int, dict[str, dict]] = {}  # round -> {peer id: stats row}, rounds not yet settled
        self._latest: dict[str, int] = {}  # peer id -> the latest round whose stats reached us
        self._settled = 0  # rounds up to this one are posted (reporter) or given up
        self._lock = threading.Lock()
        self._q: queue.Queue = queue.Queue(maxsize=256)
        self.errors = 0
        self._thread = threading.Thread(target=self._worker, name="report", daemon=True)
        self._thread.start()
        config = {"strategy": cfg.algorithm, "task": cfg.task, "rounds": cfg.rounds, "seed": cfg.seed,
                  "engine": "swarm", "partition": cfg.partition, "topology": cfg.topology}
        self._submit("run", {"run_id": self.run_id, "name": self.run_id, "config": config, "status": "running"})
        self.heartbeat(force=True)

    # -- what the peer calls -------------------------------------------------------------
    def heartbeat(self, force: bool = False, status: str = "online", telemetry: dict | None = None) -> None:
        """``telemetry``: what the peer measured (the keys of ``NodeIn.telemetry``: train_s,
        peak_rss_mb, battery_pct, cpu_temp_c, ...), shown on the dashboard's Nodes page."""
        now = time.monotonic()
        if not force and now - self._last_beat < self.min_interval_s:
            return
        self._last_beat = now
        p = self.peer
        drops = p.verifier.drop_counts()
        body = {
            "node_id": p.id, "kind": "peer", "run_id": self.run_id, "status": status,
            "info": {"round": p.round, "address": p.transport.address, "algorithm": p.cfg.algorithm,
                     "members": p.membership.count(), "dropped": drops},
            "rejected_updates": sum(drops.get(k, 0) for k in ("forged", "invalid_payload", "not_allowed")),
        }
        if telemetry:
            body["telemetry"] = dict(telemetry)
        self._submit("node", body)

    def tick(self) -> None:
        """On every heartbeat tick, before failure detection: collect the stats gossip brought,
        post the rounds they complete, and send a (rate-limited) heartbeat."""
        self._collect()
        self._flush()
        self.heartbeat()

    def round_done(self, row: dict) -> None:
        self.heartbeat(force=True)
        self._collect()
        self._flush()

    def finish(self, summary: dict) -> None:
        self._collect()
        self._flush(final=True)
        self.heartbeat(force=True, status="offline")
        if self._is_reporter():
            self._submit("status", {"status": "finished"})
        self._q.put(None)
        self._thread.join(timeout=10)
        if self.store is not None:
            self.store.close()

    # -- internals -----------------------------------------------------------------------
    def _is_reporter(self) -> bool:
        return self.peer.membership.ids()[0] == self.peer.id

    def _collect(self) -> None:
        """Keep every stats row of a round not yet settled: ours from the history, the others'
        from their membership entries (which carry only their last three rounds)."""
        p = self.peer
        with self._lock:
            for pid in p.membership.ids():
                rows = p.history[-WAIT_ROUNDS:] if pid == p.id else p.membership.info_of(pid).get("stats") or []
                for s in rows:
                    r = s.get("round") if isinstance(s, dict) else None
                    if isinstance(r, int) and not isinstance(r, bool) and r > self._settled:
                        self._seen.setdefault(r, {})[pid] = s
                        self._latest[pid] = max(r, self._latest.get(pid, 0))

    def _flush(self, final: bool = False) -> None:
        """As the reporter, post each round every live member has reported or moved past; a
        round ``WAIT_ROUNDS`` behind us, or any round at ``final``, goes with the rows it has.
        Other peers keep their last rounds, to post them if they become the reporter."""
        p = self.peer
        members, reporter = p.membership.ids(), self._is_reporter()
        with self._lock:
            for r in range(self._settled + 1, p.round + 1):
                ready = reporter and all(self._latest.get(pid, 0) >= r for pid in members)
                if not (ready or final or r <= p.round - WAIT_ROUNDS):
                    break
                stats = self._seen.pop(r, {})
                self._settled = r
                if reporter and stats:
                    self._submit("round", round_payload(r, stats))

    def _submit(self, what: str, body: dict) -> None:
        try:
            self._q.put_nowait((what, body))
        except queue.Full:
            self.errors += 1

    def _worker(self) -> None:
        while (item := self._q.get()) is not None:
            what, body = item
            try:
                if self.url:
                    self._post(what, body)
                if self.store is not None:
                    self._write(what, body)
            except Exception as exc:  # reporting must never take the peer down
                self.errors += 1
                log.info("report %s failed: %s", what, exc)

    def _post(self, what: str, body: dict) -> None:
        path = {"run": "/api/ingest/runs", "node": "/api/ingest/nodes",
                "round": f"/api/ingest/runs/{self.run_id}/rounds",
                "status": f"/api/ingest/runs/{self.run_id}/status"}[what]
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {self.token}"})
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                resp.read()
        except urllib.error.HTTPError as exc:
            if exc.code != 409:  # run or round already reported: another peer was first
                raise

    def _write(self, what: str, body: dict) -> None:
        from sqlalchemy.exc import IntegrityError

        s = self.store
        try:
            if what == "run" and s.get_run(self.run_id) is None:
                s.create_run(body["config"], name=body["name"], run_id=self.run_id, status="running")
            elif what == "node":
                extra = {"telemetry": body["telemetry"]} if body.get("telemetry") else {}
                s.upsert_node(body["node_id"], kind="peer", run_id=self.run_id, status=body["status"],
                              info=body["info"], rejected_updates=body["rejected_updates"], **extra)
            elif what == "round":
                fields = {k: v for k, v in body.items() if k not in ("round", "nodes")}
                s.add_round(self.run_id, body["round"], nodes=body["nodes"], **fields)
            elif what == "status":
                s.set_status(self.run_id, body["status"])
        except IntegrityError:
            pass  # another peer recorded it first
