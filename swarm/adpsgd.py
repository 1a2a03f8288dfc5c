"""AD-PSGD over sockets: asynchronous pairwise averaging that never half-applies and
never deadlocks (Lian et al., ICML 2018; docs/algorithms.md §3).

Each peer loops with no barrier: snapshot its model, take local steps on the snapshot,
average with one neighbour (active peers only), then apply its local update to the
averaged model: ``x_i, x_j ← (x_i + x_j)/2`` then ``x_i ← x_i − η g(x̂_i)``.

**Atomic exchange** (one connection, a two-phase request/accept/commit)::

    active i                                      passive j
    lock x_i; send AVG_REQ(x_i)           ──▶     try-lock x_j (busy: AVG_BUSY, done)
                                          ◀──     AVG_ACC(x_j); wait ≤ T for the commit
    validate x_j; if in time:
    send AVG_COMMIT; x_i ← (x_i + x_j)/2  ──▶     x_j ← (x_j + x_i)/2; unlock
    else send AVG_ABORT                    ──▶     nothing applied; unlock

Both sides apply only after both models have arrived and been validated; the passive side
applies only on the commit, and the active side commits only within ``T/2`` of the accept,
so a passive peer never times out on a commit that is on its way (the residual window is a
connection cut between the commit's send and its delivery, the two-generals limit). Both
compute ``0.5·(x_i + x_j)`` bit for bit, so the pair's sum is kept.

**No deadlock, no livelock.** Who initiates with whom comes from ``exchange_roles``: on a
bipartite graph (an even ring) only active peers initiate and only with passive ones (the
paper's split); on any other graph each edge is initiated by its lower-indexed end. A peer
already in an exchange answers AVG_BUSY at once instead of waiting, the initiation
relation has no cycle, and the highest-indexed peer being asked never initiates itself, so
simultaneous requests cannot all be refused.
"""

from __future__ import annotations

import random
import threading
import time
from typing import TYPE_CHECKING, Any

import torch
from fedswarm.algorithms.decentralized import exchange_roles, make_algorithm
from fedswarm.swarm.driver_base import Driver
from fedswarm.swarm.net.envelope import Dropped, Message
from fedswarm.swarm.net.membership import View
from fedswarm.swarm.net.payload import read_vector, vector_body
from fedswarm.swarm.net.transport import Session

if TYPE_CHECKING:
    from fedswarm.swarm.peer import Peer

__all__ = ["ADPSGDDriver"]


class ADPSGDDriver(Driver):
    catch_up = None  # asynchronous: each peer counts its own iterations

    def __init__(self, peer: Peer):
        super().__init__(peer)
        self.algo = make_algorithm("adpsgd", **peer.cfg.params)
        self.state = self.algo.init_state(peer.x0[None])
        self.lock = threading.Lock()
        self.rng = random.Random(peer.cfg.seed * 7_919 + peer.cfg.partition_id)
        self.commit_timeout_s = peer.cfg.round_timeout_s
        self.fault: str | None = None  # tests only: "no_commit", "late_commit", "nan_accept"
        self.counts = {"ok": 0, "busy": 0, "aborted": 0, "served": 0, "unreachable": 0}
        self._roles: dict[tuple, tuple[bool, list[int]]] = {}

    def model(self) -> torch.Tensor:
        return self.state.x[0]

    def role(self, view: View) -> tuple[bool, list[str]]:
        """(initiates?, the neighbours it may average with)."""
        if view.topology is None:
            return False, []
        key = view.ids
        if key not in self._roles:
            self._roles[key] = exchange_roles(view.topology)[view.index]
        me, partners = self._roles[key]
        return me, [view.ids[j] for j in partners]

    def round(self, r: int, view: View) -> dict[str, Any]:
        p, lr = self.peer, self.peer.cfg.lr
        with self.lock:
            x_hat = self.state.x[0].clone()
        res = p.train(x_hat, r)
        g = (x_hat - res.flat) / lr
        row: dict[str, Any] = {"train_loss": res.loss}
        active, partners = self.role(view)
        if active and partners:
            row["exchange"] = self.exchange(self.rng.choice(partners))
        with self.lock:
            self.algo.local_step(self.state, g[None], lr)
            self.algo.node_mix(self.state, 0, {}, {0: 1.0})  # averaged as its own event: the step alone
        row.update({f"avg_{k}": v for k, v in self.counts.items()})
        return row

    # -- active side -------------------------------------------------------------------
    def exchange(self, j: str) -> str:
        """One averaging with peer ``j``; returns "ok", "busy", "aborted" or "unreachable"."""
        p = self.peer
        addr = p.membership.addr_of(j)
        with self.lock:
            try:
                s = p.transport.open_session(addr, j, "avg", retries=0) if addr else None
            except OSError:
                s = None
            if s is None:
                return self._count("unreachable")
            try:
                meta, body = vector_body(self.state.x[0])
                req = s.send("avg_req", meta, body)
                acc = s.recv(timeout=self.commit_timeout_s, expect_re=req)
                if acc.kind != "avg_acc":
                    return self._count("busy")
                t_acc = time.monotonic()
                try:
                    x_j = read_vector(acc.meta, acc.body, p.d, finite=acc.finite)
                except Dropped as exc:
                    p.verifier.count(exc.reason)
                    s.send("avg_abort", re=acc.nonce)
                    return self._count("aborted")
                if self.fault == "no_commit":
                    return self._count("aborted")  # vanish without a word
                if self.fault == "late_commit":
                    time.sleep(self.commit_timeout_s / 2 + 0.1)
                if time.monotonic() - t_acc > self.commit_timeout_s / 2:
                    s.send("avg_abort", re=acc.nonce)
                    return self._count("aborted")
                s.send("avg_commit", re=acc.nonce)
                self.algo.node_average(self.state, x_j)
                return self._count("ok")
            except (OSError, Dropped):
                return self._count("aborted")
            finally:
                s.close()

    def _count(self, outcome: str) -> str:
        self.counts[outcome] += 1
        return outcome

    # -- passive side ------------------------------------------------------------------
    def serve(self, msg: Message, s: Session) -> bool:
        if msg.kind != "avg_req":
            return False
        p = self.peer
        try:
            x_i = read_vector(msg.meta, msg.body, p.d, finite=msg.finite).clone()
        except Dropped as exc:
            p.verifier.count(exc.reason)
            s.send("nack", {"reason": exc.reason}, re=msg.nonce)
            return True
        done = p.membership.info_of(p.id).get("done")
        if done or not self.lock.acquire(timeout=0.01):
            s.send("avg_busy", re=msg.nonce)
            return True
        try:
            x_j = self.state.x[0]
            if self.fault == "nan_accept":
                x_j = torch.full_like(x_j, float("nan"))
            meta, body = vector_body(x_j)
            acc = s.send("avg_acc", meta, body, re=msg.nonce)
            try:
                m = s.recv(timeout=self.commit_timeout_s, expect_re=acc)
            except (Dropped, OSError):
                self.counts["aborted"] += 1
                return True
            if m.kind == "avg_commit":
                self.algo.node_average(self.state, x_i)
                self.counts["served"] += 1
            else:
                self.counts["aborted"] += 1
            return True
        finally:
            self.lock.release()

    def state_dict(self) -> dict:
        return {"x": self.state.x, "step": self.state.step}

    def load_state_dict(self, s: dict) -> None:
        self.state.x, self.state.step = s["x"], int(s["step"])
