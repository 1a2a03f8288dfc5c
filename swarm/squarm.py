"""SQuARM-SGD over sockets (Singh et al., JSAIT 2021; docs/algorithms.md §7): the SQuARM object
of :mod:`fedswarm.algorithms.decentralized.squarm` on one node; this driver only routes.

One round is one iteration (the router's and the array engine's too): a Nesterov local
step, and on every ``period``-th round (a synchronization step) the object's payload, the
codec's ``q_i = C(x_i − x̂_i)`` if the event trigger fires or a tiny "skip", goes to every
neighbour; everyone adds the ``q`` they received to their copy of the sender's ``x̂`` and
the object mixes (:meth:`~fedswarm.algorithms.decentralized.squarm.SQuARM.replica_mix`).
Hyperparameters (``--set``) are the object's: ``momentum``, ``gamma``, ``period``,
``threshold``, ``codec``, ``ratio``, ``seed``.

Copies must stay equal on both ends of a link, so the driver keeps one copy per
neighbour (not the object's running sum, which a membership change would corrupt). A
message that arrives after its round is still folded in the next sync round; a
neighbour we hold no valid copy of (new after a membership change, or we restarted)
answers "need_full", and the sender then sends its ``x̂`` in full once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from fedswarm.algorithms.decentralized import make_algorithm
from fedswarm.swarm.driver_base import Driver, renormalise
from fedswarm.swarm.net.envelope import Dropped, Message
from fedswarm.swarm.net.membership import View
from fedswarm.swarm.net.payload import payload_body, read_payload, read_vector, vector_body

from fedswarm.payload import PayloadError

if TYPE_CHECKING:
    from fedswarm.swarm.peer import Peer

__all__ = ["SquarmDriver"]


class SquarmDriver(Driver):
    push_kinds = ("sq",)
    # Rounds between synchronizations send nothing and wait for nothing, so a peer behind
    # its neighbours is merely slower, not failed: it never skips rounds (each is a step).
    catch_up = None

    def __init__(self, peer: Peer):
        super().__init__(peer)
        self.algo = make_algorithm("squarm", **peer.cfg.params)
        self.state = self.algo.init_state(peer.x0[None])
        self.state.index0 = peer.cfg.partition_id
        self.replicas: dict[str, torch.Tensor] = {}  # our copy of each neighbour's x̂
        self.fresh = True  # every copy equals x0 until the first sync
        self.synced_to: set[str] = set()  # neighbours holding a valid copy of our x̂
        self.valid: set[str] = set()  # neighbours whose x̂ we hold a valid copy of

    def model(self) -> torch.Tensor:
        return self.state.x[0]

    # -- receiving ---------------------------------------------------------------------
    def accept(self, msg: Message) -> Any:
        if msg.meta.get("type") == "full":
            return ("full", read_vector(msg.meta, msg.body, self.peer.d, finite=msg.finite).clone())
        try:
            return ("q", self.algo.read_payload(read_payload(msg.meta, msg.body), self.peer.d))
        except PayloadError as exc:
            raise Dropped("invalid_payload", str(exc)) from None

    def ack_meta(self, msg: Message) -> dict:
        return {"need_full": msg.meta.get("type") != "full" and msg.sender not in self.valid}

    def _fold(self, sender: str, value: tuple) -> None:
        kind, v = value
        if kind == "full":
            self.replicas[sender] = v
            self.valid.add(sender)
        elif sender in self.valid:
            self.replicas[sender] = self.replicas[sender] + v

    # -- the round ---------------------------------------------------------------------
    def round(self, r: int, view: View) -> dict[str, Any]:
        p, lr = self.peer, self.peer.cfg.lr
        self.state.step = r - 1  # round r is iteration r, also after a catch-up skipped rounds
        grad, loss = self.gradient(self.state.x[0], r)
        sync = self.algo.is_sync(self.state.step)
        self.algo.local_step(self.state, grad[None], lr)
        if not sync:
            self.algo.replica_mix(self.state, view.index, {}, {view.index: 1.0})
            return {"train_loss": loss, "sync": False}
        nbrs = view.neighbors(r)
        if self.fresh:
            self.fresh = False
            for j in nbrs:
                self.replicas[j] = p.x0.clone()
            self.valid, self.synced_to = set(nbrs), set(nbrs)
        self.synced_to &= set(nbrs)
        self.valid &= set(nbrs)
        triggered = bool(self.state.payloads)
        q_meta, q_body = payload_body(self.algo.payload(self.state, 0))
        acks = p.push([j for j in nbrs if j in self.synced_to], "sq", r, q_body, {**q_meta, "type": "q"})
        full = [j for j in nbrs if j not in self.synced_to]
        if full:  # our x̂ after this step's q
            f_meta, f_body = vector_body(self.state.buffers["x_hat"][0] + self.state.buffers["q"][0])
            acks.update(p.push(full, "sq", r, f_body, {**f_meta, "type": "full"}))
        for j, ack in acks.items():
            if ack is not None and not ack.meta.get("need_full"):
                self.synced_to.add(j)
            else:
                self.synced_to.discard(j)
        p.inbox.wait("sq", r, nbrs, p.cfg.round_timeout_s, p.stop)
        answered = set()
        for r_old in p.inbox.rounds_of("sq"):
            if r_old <= r:
                for j, value in sorted(p.inbox.take("sq", r_old).items()):
                    self._fold(j, value)
                    if r_old == r:
                        answered.add(j)
        held = self.valid & set(nbrs)
        w = renormalise(view.weights(r), {p.id} | held)
        index = {pid: k for k, pid in enumerate(view.ids)}
        self.algo.replica_mix(self.state, view.index, {index[j]: self.replicas[j] for j in held},
                              {index[j]: v for j, v in w.items()})
        return {"train_loss": loss, "sync": True, "neighbours": len(nbrs), "answered": len(answered & set(nbrs)),
                "triggered": triggered}

    def state_dict(self) -> dict:
        s = self.state
        return {"x": s.x, "buffers": s.buffers, "step": s.step, "meta": s.meta, "replicas": dict(self.replicas)}

    def load_state_dict(self, s: dict) -> None:
        self.state.x, self.state.buffers = s["x"], dict(s["buffers"])
        self.state.step, self.state.meta = int(s["step"]), dict(s["meta"])
        self.replicas = dict(s["replicas"])
        self.fresh = False
        self.synced_to, self.valid = set(), set()  # after a restart, resynchronise every copy
