"""What every swarm driver is: the :class:`Driver` base class a peer runs its rounds through (the
message kinds it keeps, catching up with peers that finished a round, the gradient every runtime
computes) and :func:`renormalise`, the mixing row over the neighbours that answered.

The drivers themselves: gossip, scheduled and swarm_merge in :mod:`fedswarm.swarm.drivers` (which
also picks a peer's driver), lsgd in :mod:`fedswarm.swarm.leader`, squarm in
:mod:`fedswarm.swarm.squarm`, adpsgd in :mod:`fedswarm.swarm.adpsgd`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from fedswarm.algorithms.decentralized.steps import local_gradient
from fedswarm.config import round_seed
from fedswarm.swarm.net.envelope import Message
from fedswarm.swarm.net.membership import View
from fedswarm.swarm.net.payload import read_vector
from fedswarm.swarm.net.transport import Session

if TYPE_CHECKING:
    from fedswarm.swarm.peer import Peer

__all__ = ["Driver", "renormalise"]


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
        return read_vector(msg.meta, msg.body, self.peer.d, finite=msg.finite)

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
