"""The round of each algorithm over real sockets: what a peer sends, to whom, what it
waits for and how it mixes. The math lives in the algorithm objects
(:mod:`fedswarm.algorithms.decentralized`); a driver only routes the algorithm's
:class:`~fedswarm.payload.Payload` and renormalises the mixing weights over the
neighbours that answered. One round is one iteration of the algorithm: the gradient
(:func:`fedswarm.algorithms.decentralized.steps.local_gradient`, the seed of
:func:`~fedswarm.config.round_seed`) is the one the router's nodes
and the array engine compute, so the three runtimes agree.

=============  ======================================  ==========================================
driver         per round                               bytes per peer per round
=============  ======================================  ==========================================
gossip         push the payload to each neighbour, mix  payload·deg sent (+ envelopes)
swarm_merge    model to the leader, merged model back   4d up, 4d down; leader (P−1)·4d each way
lsgd           see :mod:`fedswarm.swarm.leader`         12 B·(P−1) + 4d per pull (non-leaders)
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
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from fedswarm.algorithms.decentralized import (ALGORITHMS, make_algorithm, make_schedule,
                                              merge_leader, uses_fixed_schedule, weighted_merge)
from fedswarm.swarm.net.envelope import Dropped, Message
from fedswarm.swarm.net.membership import View
from fedswarm.swarm.net.payload import payload_body, read_payload, read_vector
from fedswarm.swarm.adpsgd import ADPSGDDriver
from fedswarm.swarm.driver_base import Driver, renormalise
from fedswarm.swarm.leader import LeaderDriver
from fedswarm.swarm.squarm import SquarmDriver

from fedswarm.payload import Payload, PayloadError

if TYPE_CHECKING:
    from fedswarm.swarm.peer import Peer

log = logging.getLogger("fedswarm.swarm")

__all__ = ["Driver", "GossipDriver", "ScheduledDriver", "SwarmMergeDriver", "algorithm_description",
           "algorithm_names", "make_driver"]


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
            x = read_vector(msg.meta, msg.body, self.peer.d, finite=msg.finite)
            payload = Payload({"vector": x}, {"kind": "dense"})
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

    def load_state_dict(self, s: dict) -> None:
        self.state.x, self.state.buffers = s["x"], dict(s["buffers"])
        self.state.step, self.state.meta = int(s["step"]), dict(s["meta"])


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
        x = read_vector(msg.meta, msg.body, self.peer.d, finite=msg.finite)
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


#: algorithm objects whose ``node_mix`` a peer drives as is (GossipDriver)
GOSSIP_OBJECTS = ("dpsgd", "d2", "dsgdm", "qgm", "easgd", "dasgd")
#: asynchronous algorithms with a fixed-schedule mode (``ScheduledDriver``)
SCHEDULED = ("adpsgd", "prague")
#: the others the swarm runs, each with its own driver
SWARM_ONLY = {"swarm_merge": "Swarm Learning: each round an elected leader merges by weighted mean and "
                             "redistributes (Warnat-Herresthal et al., Nature 2021; docs/algorithms.md §16)"}


def _prague(peer: Peer) -> Driver:
    raise ValueError("prague on the swarm replays a fixed schedule only: --set schedule=fixed")


#: Every algorithm ``fedswarm peer --algorithm`` runs -> its driver (a class or a function of the
#: peer); those of :data:`SCHEDULED` replay a fixed schedule (``ScheduledDriver``) with
#: ``--set schedule=fixed`` instead. A new swarm algorithm is one entry here.
DRIVERS: dict[str, Callable[[Peer], Driver]] = {
    **{name: GossipDriver for name in GOSSIP_OBJECTS},
    "adpsgd": ADPSGDDriver,
    "prague": _prague,
    "lsgd": LeaderDriver,
    "squarm": SquarmDriver,
    **{name: SwarmMergeDriver for name in SWARM_ONLY},
}


def algorithm_names() -> list[str]:
    """What ``fedswarm peer --algorithm`` accepts."""
    return list(DRIVERS)


def algorithm_description(name: str) -> str:
    return SWARM_ONLY[name] if name in SWARM_ONLY else ALGORITHMS[name].description


def make_driver(peer: Peer) -> Driver:
    name = peer.cfg.algorithm
    if name in SCHEDULED and peer.cfg.params.get("schedule") == "fixed":
        return ScheduledDriver(peer)
    if name not in DRIVERS:
        raise ValueError(f"unknown swarm algorithm '{name}' (available: {', '.join(algorithm_names())})")
    return DRIVERS[name](peer)
