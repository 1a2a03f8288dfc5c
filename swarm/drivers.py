"""The round of each algorithm over real sockets: what a peer sends, to whom, what it
waits for and how it mixes. The math lives in the algorithm objects
(:mod:`fedswarm.algorithms.decentralized`); a driver only routes the algorithm's
:class:`~fedswarm.payload.Payload` and renormalises the mixing weights over the
neighbours that answered. One round is one iteration of the algorithm: the gradient
(:func:`fedswarm.strategies.decentralized.steps.local_gradient`, the seed of
:func:`~fedswarm.config.round_seed`) is the one the router's nodes
and the array engine compute, so the three runtimes agree.

=============  ======================================  ==========================================
driver         per round                               bytes per peer per round
=============  ======================================  ==========================================
gossip         push the payload to each neighbour, mix  payload·deg sent (+ envelopes)
swarm_merge    model to the leader, merged model back   4d up, 4d down; leader (P−1)·4d each way
lsgd           when a pull is due: loss to all, pull     12 B·(P−1) + 4d per pull (non-leaders)
squarm         codec(x − x̂) to neighbours if triggered  codec bytes·deg every H rounds
adpsgd         see :mod:`fedswarm.swarm.adpsgd`         4d each way per averaging
scheduled      gossip along a fixed schedule's tick      4d to each partner of the tick
=============  ======================================  ==========================================

AD-PSGD and Prague have two modes (the algorithm's ``schedule`` parameter). ``clock``
(default): AD-PSGD peers pair by message timing (:mod:`fedswarm.swarm.adpsgd`); Prague
has no timed swarm form. ``fixed``: :class:`ScheduledDriver` replays the seeded fixed
schedule of :mod:`fedswarm.algorithms.decentralized.schedule` (round ``r`` is tick ``r``:
its pairs or groups exchange models, each gradient as stale as the schedule says), the
same events the array engine and the Flower router replay, for tests, replays and
comparisons (``fedswarm peer --algorithm adpsgd --set schedule=fixed``).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import TYPE_CHECKING, Any

import torch
from fedswarm.algorithms.decentralized import (ALGORITHMS, leader_server_update, make_algorithm, make_schedule,
                                              merge_leader, uses_fixed_schedule, weighted_merge)
from fedswarm.algorithms.decentralized.leader import contiguous_groups
from fedswarm.config import round_seed
from fedswarm.strategies.decentralized.steps import local_gradient
from fedswarm.swarm.net.envelope import Dropped, Message
from fedswarm.swarm.net.membership import View
from fedswarm.swarm.net.payload import payload_body, read_payload, read_vector, vector_body
from fedswarm.swarm.net.transport import Session

from fedswarm.payload import Payload, PayloadError

if TYPE_CHECKING:
    from fedswarm.swarm.peer import Peer

log = logging.getLogger("fedswarm.swarm")

__all__ = ["Driver", "GossipDriver", "LeaderDriver", "ScheduledDriver", "SwarmMergeDriver", "algorithm_description",
           "algorithm_names", "make_driver"]


def renormalise(weights: dict[str, float], keep: set[str]) -> dict[str, float]:
    """The mixing row restricted to ``keep`` (ourselves and who answered), rescaled to sum
    to 1: a silent neighbour's weight is shared out, not lost."""
    w = {j: v for j, v in weights.items() if j in keep}
    total = sum(w.values())
    return {j: v / total for j, v in w.items()}


class Driver:
    """Base class. ``push_kinds`` are the message kinds stored in the inbox after
    :meth:`accept` validates them; anything else goes to :meth:`serve`."""

    push_kinds: tuple[str, ...] = ()
    catch_up = "neighbours"  # whose completed rounds let a lagging peer skip ahead (None: never)

    def __init__(self, peer: Peer):
        self.peer = peer

    def model(self) -> torch.Tensor:
        raise NotImplementedError

    def round(self, r: int, view: View) -> dict[str, Any]:
        raise NotImplementedError

    def accept(self, msg: Message) -> Any:
        return read_vector(msg.meta, msg.body, self.peer.d)

    def ack_meta(self, msg: Message) -> dict:
        return {}

    def serve(self, msg: Message, s: Session) -> bool:
        return False

    def next_round(self, r: int) -> int:
        """``r``, or a later round if the peers we depend on already finished ``r``."""
        if self.catch_up is None:
            return r
        view = self.peer.view()
        ref = view.neighbors(r) if self.catch_up == "neighbours" else [p for p in view.ids if p != self.peer.id]
        done = max((int(self.peer.membership.info_of(p).get("round", 0) or 0) for p in ref), default=0)
        return done + 1 if done >= r else r

    def state_dict(self) -> dict:
        return {"x": self.model()}

    def load_state_dict(self, s: dict) -> None:
        raise NotImplementedError

    def gradient(self, x: torch.Tensor, r: int) -> tuple[torch.Tensor, float]:
        """This peer's gradient for round (iteration) ``r`` at ``x``, as every runtime
        computes it."""
        c = self.peer.cfg
        return local_gradient(self.peer.trainer, x, steps=c.local_steps or 1, batch_size=c.batch_size, lr=c.lr,
                              seed=round_seed(c.seed, r, c.partition_id))


class GossipDriver(Driver):
    """Synchronous gossip with an algorithm object of :mod:`fedswarm.algorithms.decentralized`
    (dpsgd, d2, dsgdm, qgm, easgd, dasgd): the same ``local_step``/``payload``/``node_mix``
    calls as the router's nodes, with ``node_mix``'s weights renormalised over the
    neighbours that answered."""

    push_kinds = ("model",)

    def __init__(self, peer: Peer):
        super().__init__(peer)
        self.algo = make_algorithm(peer.cfg.algorithm, **peer.cfg.params)
        self.state = self.algo.init_state(peer.x0[None])
        self.state.index0 = peer.cfg.partition_id
        self._checked: set[tuple] = set()

    def model(self) -> torch.Tensor:
        return self.state.x[0]

    def accept(self, msg: Message) -> Any:
        """The neighbour's message: a payload frame, or a bare float32 vector frame (a
        dense message, as ``Peer.send_model`` sends), checked and decoded by the algorithm."""
        if "arrays" in msg.meta:
            payload = read_payload(msg.meta, msg.body)
        else:
            payload = Payload({"vector": read_vector(msg.meta, msg.body, self.peer.d)}, {"kind": "dense"})
        try:
            return self.algo.read_payload(payload, self.peer.d)
        except PayloadError as exc:
            raise Dropped("invalid_payload", str(exc)) from None

    def round(self, r: int, view: View) -> dict[str, Any]:
        p, lr = self.peer, self.peer.cfg.lr
        if view.topology is not None and (view.ids, r % view.topology.period) not in self._checked:
            self.algo.check_topology(view.topology)
            self._checked.add((view.ids, r % view.topology.period))
        self.state.step = r - 1  # round r is iteration r, also after a catch-up skipped rounds
        nbrs, weights, stale = self.graph(view, r)
        grad, loss = self.gradient(self.algo.gradient_point(self.state, 0, stale), r)
        self.algo.local_step(self.state, grad[None], lr)
        meta, body = payload_body(self.algo.payload(self.state, 0))
        p.push(nbrs, "model", r, body, meta)
        got = p.inbox.wait("model", r, nbrs, p.cfg.round_timeout_s, p.stop)
        w = renormalise(weights, {p.id, *got})
        index = {pid: k for k, pid in enumerate(view.ids)}
        self.algo.node_mix(self.state, view.index, {index[j]: v for j, v in got.items()},
                           {index[j]: v for j, v in w.items()})
        return {"train_loss": loss, "neighbours": len(nbrs), "answered": len(got)}

    def graph(self, view: View, r: int) -> tuple[list[str], dict[str, float], int]:
        """Round ``r``'s neighbours, this peer's mixing row and its gradient staleness."""
        return view.neighbors(r), view.weights(r), 0

    def state_dict(self) -> dict:
        s = self.state
        return {"x": s.x, "buffers": s.buffers, "step": s.step, "meta": s.meta}


class ScheduledDriver(GossipDriver):
    """AD-PSGD or Prague replaying a seeded fixed schedule (``schedule="fixed"``; see the
    module docstring): round ``r`` is tick ``r`` of ``make_schedule(algo, topology of the
    sorted members, seed)``, so every peer draws the same events. The partners of the
    tick exchange their payloads and ``node_mix`` with the tick's row (a peer in no pair
    or group mixes with itself alone); the gradient is taken at
    ``algo.gradient_point(state, 0, staleness)``. Every round runs (no catch-up: a replay
    skips nothing); a partner that stays silent past ``round_timeout_s`` is mixed without,
    as in any gossip round, and the replay is then no longer exact (logged per round as
    ``answered < neighbours``)."""

    catch_up = None

    def __init__(self, peer: Peer):
        super().__init__(peer)
        if not uses_fixed_schedule(self.algo):
            raise ValueError(f"{self.algo.name}: the scheduled driver needs schedule='fixed'")
        self._schedules: dict[tuple, Any] = {}

    def graph(self, view: View, r: int) -> tuple[list[str], dict[str, float], int]:
        if view.topology is None:
            return [], {view.ids[view.index]: 1.0}, 0
        sched = self._schedules.get(view.ids)
        if sched is None:
            sched = self._schedules[view.ids] = make_schedule(self.algo, view.topology, self.peer.cfg.seed)
        i = view.index
        return ([view.ids[j] for j in sched.neighbors(i, r)],
                {view.ids[j]: w for j, w in sched.weights(i, r).items()}, sched.staleness(i, r))

    def load_state_dict(self, s: dict) -> None:
        self.state.x, self.state.buffers = s["x"], dict(s["buffers"])
        self.state.step, self.state.meta = int(s["step"]), dict(s["meta"])


class SwarmMergeDriver(Driver):
    """Swarm Learning's round (docs/algorithms.md §16): local training, then the round's leader
    (``merge_leader``: the round number indexes the sorted live members) collects every
    model, merges by sample-weighted mean and sends the merge back. Blockchain, SPIFFE
    identities and minPeers are replaced by signed messages, the allow list and the
    membership view; if the leader is gone the round times out and the next one leads."""

    push_kinds = ("contrib", "merged")
    catch_up = "all"

    def __init__(self, peer: Peer):
        super().__init__(peer)
        self.x = peer.x0.clone()

    def model(self) -> torch.Tensor:
        return self.x

    def accept(self, msg: Message) -> Any:
        x = read_vector(msg.meta, msg.body, self.peer.d)
        if msg.kind == "merged":
            return x
        w = msg.meta.get("weight")
        if not isinstance(w, (int, float)) or isinstance(w, bool) or not 0 < w < 2**31:
            raise Dropped("invalid_payload", f"merge weight {w!r} is not a positive number")
        return (x, float(w))

    def round(self, r: int, view: View) -> dict[str, Any]:
        p = self.peer
        res = p.train(self.x, r)
        self.x, n = res.flat, float(res.num_examples)
        leader = merge_leader(view.ids, r)
        row = {"train_loss": res.loss, "leader": leader[:8], "merged": False}
        if view.n == 1:
            return row
        if leader == p.id:
            others = [j for j in view.ids if j != p.id]
            got = p.inbox.wait("contrib", r, others, p.cfg.round_timeout_s, p.stop)
            models = [self.x] + [got[j][0] for j in sorted(got)]
            self.x = weighted_merge(models, [n] + [got[j][1] for j in sorted(got)])
            p.send_model(sorted(got), "merged", r, self.x)
            row.update(merged=True, contributors=len(got))
        else:
            ack = p.send_model([leader], "contrib", r, self.x, {"weight": n})[leader]
            if ack is not None:
                got = p.inbox.wait("merged", r, [leader], 2 * p.cfg.round_timeout_s, p.stop)
                if leader in got:
                    self.x = got[leader].clone()
                    row["merged"] = True
        return row

    def load_state_dict(self, s: dict) -> None:
        self.x = s["x"]


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
            x = read_vector(msg.meta, msg.body, self.peer.d).clone()
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
            return read_vector(resp.meta, resp.body, p.d).clone() if resp.kind == "model" else None
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
            return read_vector(resp.meta, resp.body, p.d).clone() if resp.kind == "model" else None
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


#: algorithm objects whose ``node_mix`` a peer drives as is (GossipDriver)
GOSSIP_OBJECTS = ("dpsgd", "d2", "dsgdm", "qgm", "easgd", "dasgd")
#: asynchronous algorithms with a fixed-schedule mode (``ScheduledDriver``)
SCHEDULED = ("adpsgd", "prague")
#: the others the swarm runs, each with its own driver
SWARM_ONLY = {"swarm_merge": "Swarm Learning: each round an elected leader merges by weighted mean and "
                             "redistributes (Warnat-Herresthal et al., Nature 2021; docs/algorithms.md §16)"}


def algorithm_names() -> list[str]:
    """What ``fedswarm peer --algorithm`` accepts."""
    return [*GOSSIP_OBJECTS, "adpsgd", "prague", "lsgd", "squarm", *SWARM_ONLY]


def algorithm_description(name: str) -> str:
    return SWARM_ONLY[name] if name in SWARM_ONLY else ALGORITHMS[name].description


def make_driver(peer: Peer) -> Driver:
    name = peer.cfg.algorithm
    if name == "swarm_merge":
        return SwarmMergeDriver(peer)
    if name == "lsgd":
        return LeaderDriver(peer)
    if name == "squarm":
        from fedswarm.swarm.squarm import SquarmDriver

        return SquarmDriver(peer)
    if name in SCHEDULED and peer.cfg.params.get("schedule") == "fixed":
        return ScheduledDriver(peer)
    if name == "adpsgd":
        from fedswarm.swarm.adpsgd import ADPSGDDriver

        return ADPSGDDriver(peer)
    if name == "prague":
        raise ValueError("prague on the swarm replays a fixed schedule only: --set schedule=fixed")
    if name in GOSSIP_OBJECTS:
        return GossipDriver(peer)
    raise ValueError(f"unknown swarm algorithm '{name}' (available: {', '.join(algorithm_names())})")
