"""SQuARM-SGD over sockets (Singh et al., JSAIT 2021; docs/algorithms.md §7), with the codecs
of :mod:`fedswarm.algorithms.compression.codecs`.

Each round is one synchronisation period of ``local_steps`` Nesterov steps; then, if the
event trigger fires, ``q_i = C(x_i − x̂_i)`` goes to every neighbour as a codec payload
(else a tiny "skip"), everyone adds the ``q`` they received to their public copies, and
``x ← x + γ Σ_j w_ij (x̂_j − x̂_i)``. Hyperparameters (``--set``): ``momentum``,
``gamma``, ``threshold`` (c of the trigger ``‖x − x̂‖² > c·η²``), ``codec`` and, for codecs
that take one, ``ratio``.

Copies must stay equal on both ends of a link. A message that arrives after its round
is still folded in the next round; a neighbour we hold no valid copy of (new after a
membership change, or we restarted) answers "need_full", and the sender then sends its
``x̂`` in full once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from fedswarm.algorithms.compression.codecs import make_codec
from fedswarm.swarm.algorithms import SWARM_ALGORITHMS, SquarmNode
from fedswarm.swarm.drivers import Driver, renormalise
from fedswarm.swarm.net.envelope import Dropped, Message
from fedswarm.swarm.net.membership import View
from fedswarm.swarm.net.payload import payload_body, read_payload, read_vector, vector_body

from fedswarm.params import set_flat
from fedswarm.payload import PayloadError

if TYPE_CHECKING:
    from fedswarm.swarm.peer import Peer

__all__ = ["SquarmDriver"]


class SquarmDriver(Driver):
    push_kinds = ("sq",)

    def __init__(self, peer: Peer):
        super().__init__(peer)
        p = {**SWARM_ALGORITHMS["squarm"][1], **peer.cfg.params}
        self.node = SquarmNode(peer.x0, p["momentum"], p["gamma"], p["threshold"])
        codec_params = {"ratio": p["ratio"]} if p["codec"] in ("topk", "randk") else {}
        self.codec = make_codec(p["codec"], **codec_params)
        self.layout = peer.trainer.layout
        self.fresh = True  # every copy equals x0 until the first round
        self.synced_to: set[str] = set()  # neighbours holding a valid copy of our x̂
        self.valid: set[str] = set()  # neighbours whose x̂ we hold a valid copy of

    def model(self) -> torch.Tensor:
        return self.node.x

    # -- receiving ---------------------------------------------------------------------
    def accept(self, msg: Message) -> Any:
        kind = msg.meta.get("type")
        if kind == "skip":
            return ("skip", None)
        if kind == "full":
            return ("full", read_vector(msg.meta, msg.body, self.peer.d).clone())
        if kind == "q":
            try:
                q = self.codec.decode(read_payload(msg.meta, msg.body), self.layout)[0]
            except PayloadError as exc:
                raise Dropped("invalid_payload", str(exc)) from None
            return ("q", q)
        raise Dropped("malformed", f"unknown squarm message type {kind!r}")

    def ack_meta(self, msg: Message) -> dict:
        return {"need_full": msg.meta.get("type") == "q" and msg.sender not in self.valid}

    def _fold(self, sender: str, value: tuple) -> None:
        kind, v = value
        if kind == "full":
            self.node.nbr_hat[sender] = v
            self.valid.add(sender)
        elif kind == "q" and sender in self.valid:
            self.node.nbr_hat[sender] = self.node.nbr_hat[sender] + v

    # -- the round ---------------------------------------------------------------------
    def _local_steps(self, r: int) -> float:
        from fedswarm.config import round_seed

        p, c = self.peer, self.peer.cfg
        tr = p.trainer
        params = [q for q in tr.model.parameters() if q.requires_grad]
        gen = torch.Generator().manual_seed(round_seed(c.seed, r, c.partition_id))
        n = tr.num_examples
        order, pos, total = torch.randperm(n, generator=gen), 0, 0.0
        tr.model.train()
        for _ in range(c.local_steps):
            if pos >= n:
                order, pos = torch.randperm(n, generator=gen), 0
            idx = order[pos : pos + c.batch_size]
            pos += c.batch_size
            set_flat(tr.model, self.node.x)
            tr.model.zero_grad(set_to_none=True)
            loss = tr.task.objective(tr.model, tr.x[idx], tr.y[idx])
            loss.backward()
            g = torch.cat([(q.grad if q.grad is not None else torch.zeros_like(q)).reshape(-1) for q in params])
            self.node.nesterov_step(g.detach().to(torch.float32), c.lr)
            total += loss.item()
        return total / max(1, c.local_steps)

    def round(self, r: int, view: View) -> dict[str, Any]:
        p, lr = self.peer, self.peer.cfg.lr
        nbrs = view.neighbors(r)
        if self.fresh:
            self.fresh = False
            for j in nbrs:
                self.node.nbr_hat[j] = p.x0.clone()
            self.valid, self.synced_to = set(nbrs), set(nbrs)
        self.synced_to &= set(nbrs)
        self.valid &= set(nbrs)
        loss = self._local_steps(r)
        triggered = self.node.triggered(lr)
        if triggered:
            payload = self.codec.encode((self.node.x - self.node.x_hat)[None], self.layout, seed=r)
            self.node.x_hat = self.node.x_hat + self.codec.decode(payload, self.layout)[0]
            q_meta, q_body = payload_body(payload)
            q_meta["type"] = "q"
        else:
            q_meta, q_body = {"type": "skip"}, b""
        full = [j for j in nbrs if j not in self.synced_to]
        acks = p.push([j for j in nbrs if j in self.synced_to], "sq", r, q_body, q_meta)
        if full:
            f_meta, f_body = vector_body(self.node.x_hat)
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
        w = renormalise(view.weights(r), {p.id} | (self.valid & set(nbrs)))
        self.node.consensus(w, p.id)
        return {"train_loss": loss, "neighbours": len(nbrs), "answered": len(answered & set(nbrs)),
                "triggered": triggered}

    def state_dict(self) -> dict:
        return {"node": self.node.state_dict()}

    def load_state_dict(self, s: dict) -> None:
        self.node.load_state_dict(s["node"])
        self.fresh = False
        self.synced_to, self.valid = set(), set()  # after a restart, resynchronise every copy
