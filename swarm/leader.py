"""Leader SGD over sockets (docs/algorithms.md §9): the LSGD object's three modes routed
between peers. Sync modes: when a pull is due each peer sends its loss to all members and
pulls towards the elected leaders' models; async: leader servers hosted on peers. Bytes per
peer per pull: 12 B·(P−1) of losses + 4d for the leader's model (non-leaders).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import TYPE_CHECKING, Any

import torch
from fedswarm.algorithms.decentralized import leader_server_update, make_algorithm
from fedswarm.algorithms.decentralized.leader import contiguous_groups
from fedswarm.swarm.driver_base import Driver
from fedswarm.swarm.net.envelope import Dropped, Message
from fedswarm.swarm.net.membership import View
from fedswarm.swarm.net.payload import read_vector, vector_body
from fedswarm.swarm.net.transport import Session

if TYPE_CHECKING:
    from fedswarm.swarm.peer import Peer

log = logging.getLogger("fedswarm.swarm")

__all__ = ["LeaderDriver"]


class LeaderDriver(Driver):
    """Leader SGD (docs/algorithms.md §9) with the LSGD object of
    :mod:`fedswarm.algorithms.decentralized.leader`, in its three modes. One round is one
    iteration; node ``i`` is the ``i``-th of the sorted members, groups are contiguous.

    * ``multi`` / ``single``: when a pull is due each peer sends its loss estimate to all
      members, the object names the leaders (``node_pulls``), the peer fetches each
      leader's model as it was before this step's pulls and the object applies the pulls.
      Peers whose loss does not arrive in time are not candidates.
    * ``async``: the leader servers live on peers, the global one on member 0 and each
      group's on the group's first member. A due worker sends its loss and model to the
      server (``lead`` request); the server applies ``leader_server_update`` and answers
      with its leader copy, which the worker pulls towards. No barrier between workers;
      a server takes the reports of its fixed schedule in (round, node) order, waiting at
      most ``round_timeout_s`` for an earlier one, so a run is reproducible (and equal to
      the array engine's) while every peer is alive.
    """

    push_kinds = ("loss",)
    catch_up = None  # rounds without a pull wait for nobody: a peer behind is slower, not failed

    def __init__(self, peer: Peer):
        super().__init__(peer)
        self.algo = make_algorithm("lsgd", **peer.cfg.params)
        self.state = self.algo.init_state(peer.x0[None])
        self.state.index0 = peer.cfg.partition_id
        self.snapshots: dict[int, torch.Tensor] = {}
        self._cv = threading.Condition()
        # async: the servers this peer hosts, kind -> [leader copy, its loss]; reports done
        self.servers: dict[str, list] = {}
        self.served: dict[str, set[tuple[int, int]]] = {"local": set(), "global": set()}

    def model(self) -> torch.Tensor:
        return self.state.x[0]

    def accept(self, msg: Message) -> Any:
        return self._finite_loss(msg.meta.get("loss"))

    @staticmethod
    def _finite_loss(loss: Any) -> float:
        if not isinstance(loss, (int, float)) or isinstance(loss, bool) or not math.isfinite(loss):
            raise Dropped("invalid_payload", f"loss {loss!r} is not a finite number")
        return float(loss)

    def serve(self, msg: Message, s: Session) -> bool:
        if msg.kind == "lead":
            self._serve_lead(msg, s)
            return True
        if msg.kind != "pull":
            return False
        r = msg.meta.get("round")
        with self._cv:
            self._cv.wait_for(lambda: r in self.snapshots or self.peer.stop.is_set(),
                              timeout=self.peer.cfg.round_timeout_s)
            x = self.snapshots.get(r)
        if x is None:
            s.send("nack", {"reason": "no snapshot for that round"}, re=msg.nonce)
        else:
            meta, body = vector_body(x)
            s.send("model", meta, body, re=msg.nonce)
        return True

    # -- async: the leader servers -----------------------------------------------------
    def _server_of(self, kind: str, j: int, view: View) -> int:
        """Node index of the peer hosting node ``j``'s ``kind`` server."""
        if kind == "global":
            return 0
        return next(g for g in contiguous_groups(view.n, self.algo.groups) if j in g)[0]

    def _due_before(self, kind: str, r: int, j: int, view: View) -> list[tuple[int, int]]:
        """Reports this server takes before node ``j``'s of round ``r``: the fixed schedule."""
        me = view.index
        members = [k for k in range(view.n) if self._server_of(kind, k, view) == me]
        out = []
        for rr in range(max(1, r - max(self.algo.tau_local, self.algo.tau_global)), r + 1):
            for k in members:
                if (rr, k) < (r, j) and self.algo.due(rr - 1, k)[0 if kind == "local" else 1]:
                    out.append((rr, k))
        return out

    def _server_report(self, kind: str, r: int, j: int, x: torch.Tensor, f: float, view: View) -> torch.Tensor:
        """Take node ``j``'s report on this peer's ``kind`` server; return the leader copy."""
        before = self._due_before(kind, r, j, view)
        with self._cv:
            self._cv.wait_for(lambda: all(k in self.served[kind] for k in before) or self.peer.stop.is_set(),
                              timeout=self.peer.cfg.round_timeout_s)
            lead = self.servers.setdefault(kind, [self.peer.x0.clone(), float("inf")])
            lead[0], lead[1], _ = leader_server_update(lead[0], lead[1], x, f)
            self.served[kind].add((r, j))
            self._cv.notify_all()
            return lead[0].clone()

    def _member_view(self, sender: str) -> View:
        """Our view once it includes ``sender`` and the swarm's minimum size (a report can
        arrive while this peer is still joining), or as it is after ``round_timeout_s``."""
        p = self.peer
        deadline = time.monotonic() + p.cfg.round_timeout_s
        view = p.view()
        while (sender not in view.ids or view.n < p.cfg.min_peers) and time.monotonic() < deadline:
            if p.stop.wait(0.02):
                break
            view = p.view()
        return view

    def _serve_lead(self, msg: Message, s: Session) -> None:
        view = self._member_view(msg.sender)
        try:
            kind, r = msg.meta.get("kind"), msg.meta.get("round")
            if kind not in ("local", "global") or not isinstance(r, int) or isinstance(r, bool):
                raise Dropped("malformed", "a lead report needs kind local|global and an integer round")
            if msg.sender not in view.ids:
                raise Dropped("malformed", "lead report from a non-member")
            j = view.ids.index(msg.sender)
            if self._server_of(kind, j, view) != view.index:
                raise Dropped("malformed", f"this peer does not host node {j}'s {kind} leader server")
            f = self._finite_loss(msg.meta.get("loss"))
            x = read_vector(msg.meta, msg.body, self.peer.d, finite=msg.finite).clone()
        except Dropped as exc:
            self.peer.verifier.count(exc.reason)
            log.warning("%s: refused lead report from %s: %s", self.peer.ident.short_id, msg.sender[:8], exc)
            s.send("nack", {"reason": exc.reason}, re=msg.nonce)
            return
        meta, body = vector_body(self._server_report(kind, r, j, x, f, view))
        s.send("model", meta, body, re=msg.nonce)

    def _async_round(self, r: int, view: View, row: dict[str, Any]) -> None:
        i = view.index
        local, glob = self.algo.due(self.state.step, i)
        f = self.algo.loss_estimate(self.state)
        for kind, c, is_due in (("local", self.algo.c1, local), ("global", self.algo.c2, glob)):
            if not is_due or view.n == 1:
                continue
            server = self._server_of(kind, i, view)
            x = self.state.x[0].clone()
            if server == i:
                lead = self._server_report(kind, r, i, x, f, view)
            else:
                lead = self._request_lead(view.ids[server], kind, r, x, f)
            if lead is not None:
                self.algo.node_pull(self.state, lead, c)
                row[f"pulled_{kind}"] = True
        self.algo.end_node_step(self.state, local or glob)

    def _request_lead(self, server: str, kind: str, r: int, x: torch.Tensor, f: float) -> torch.Tensor | None:
        p = self.peer
        addr = p.membership.addr_of(server)
        if addr is None:
            return None
        meta, body = vector_body(x)
        try:
            resp = p.transport.request(addr, server, "lead", {**meta, "kind": kind, "round": r, "loss": f}, body,
                                       timeout=2 * p.cfg.round_timeout_s)
            return read_vector(resp.meta, resp.body, p.d, finite=resp.finite).clone() if resp.kind == "model" else None
        except Dropped as exc:
            if exc.reason == "invalid_payload":
                p.verifier.count(exc.reason)
        except OSError:
            pass
        return None

    # -- sync: all-gather the losses, pull from the elected leaders --------------------
    def _fetch(self, leader: str, r: int) -> torch.Tensor | None:
        p = self.peer
        addr = p.membership.addr_of(leader)
        if addr is None:
            return None
        try:
            resp = p.transport.request(addr, leader, "pull", {"round": r}, timeout=2 * p.cfg.round_timeout_s)
            return read_vector(resp.meta, resp.body, p.d, finite=resp.finite).clone() if resp.kind == "model" else None
        except Dropped as exc:
            if exc.reason == "invalid_payload":  # transport-level drops are counted already
                p.verifier.count(exc.reason)
        except OSError:
            pass
        return None

    def round(self, r: int, view: View) -> dict[str, Any]:
        p = self.peer
        self.state.step = r - 1  # round r is iteration r
        grad, loss = self.gradient(self.state.x[0], r)
        self.algo.local_step(self.state, grad[None], p.cfg.lr, losses=[loss])
        row: dict[str, Any] = {"train_loss": loss}
        if self.algo.mode == "async":
            self._async_round(r, view, row)
            return row
        if not any(self.algo.due(self.state.step)) or view.n == 1:
            self.algo.finish_node_pulls(self.state, [], [])
            return row
        with self._cv:
            self.snapshots[r] = self.state.x[0].clone()
            for old in [k for k in self.snapshots if k < r - 2 * self.algo.tau_global]:
                del self.snapshots[old]
            self._cv.notify_all()
        others = [j for j in view.ids if j != p.id]
        f = self.algo.loss_estimate(self.state)
        p.push(others, "loss", r, meta={"loss": f})
        got = p.inbox.wait("loss", r, others, p.cfg.round_timeout_s, p.stop)
        index = {pid: k for k, pid in enumerate(view.ids)}
        losses = {index[j]: v for j, v in got.items()}
        losses[view.index] = f
        pulls = self.algo.node_pulls(self.state, view.index, view.n, losses)
        models = [None if lead == view.index else self._fetch(view.ids[lead], r) for lead, _ in pulls]
        self.algo.finish_node_pulls(self.state, pulls, models)
        row.update(leader=view.ids[pulls[-1][0]][:8], candidates=len(losses),
                   pulled=any(m is not None for m in models))
        return row

    def state_dict(self) -> dict:
        s = self.state
        return {"x": s.x, "buffers": s.buffers, "step": s.step, "meta": s.meta, "servers": dict(self.servers)}

    def load_state_dict(self, s: dict) -> None:
        self.state.x, self.state.buffers = s["x"], dict(s["buffers"])
        self.state.step, self.state.meta = int(s["step"]), dict(s["meta"])
        self.servers = dict(s.get("servers", {}))
