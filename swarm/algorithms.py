"""Per-node math of the swarm-only algorithms: Leader SGD, Swarm Learning's merge and
SQuARM-SGD. (D-PSGD, D², DSGDm, QG-DSGDm and AD-PSGD come from
:mod:`fedswarm.algorithms.decentralized`; these three have no object there yet and belong in
``strategies/`` once they do: none of this touches a socket.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

__all__ = ["SWARM_ALGORITHMS", "SquarmNode", "elect_leader", "leader_pull", "merge_leader", "weighted_merge"]

#: name -> (description, hyperparameter defaults); the gossip objects' names are added by the peer
SWARM_ALGORITHMS: dict[str, tuple[str, dict]] = {
    "lsgd": (("Leader SGD: every tau rounds each peer pulls towards the lowest-loss peer "
              "(Teng et al., NeurIPS 2019; algorithms.md §9)"), {"tau": 2, "pull": 0.5}),
    "swarm_merge": (("Swarm Learning: each round an elected leader merges by weighted mean and "
                     "redistributes (Warnat-Herresthal et al., Nature 2021; algorithms.md §16)"), {}),
    "squarm": (("SQuARM-SGD: Nesterov momentum, event-triggered compressed gossip of x - x_hat "
                "(Singh et al., JSAIT 2021; algorithms.md §7)"),
               {"momentum": 0.9, "gamma": 0.5, "threshold": 0.0, "codec": "topk", "ratio": 0.1}),
}


# -- LSGD (§9) -------------------------------------------------------------------------
def elect_leader(losses: Mapping[str, float]) -> str:
    """The peer with the lowest reported loss (ties: the lowest id), ``j* = argmin f(x_j)``."""
    if not losses:
        raise ValueError("no losses to elect a leader from")
    return min(losses, key=lambda pid: (losses[pid], pid))


def leader_pull(x: torch.Tensor, leader_x: torch.Tensor, pull: float) -> torch.Tensor:
    """LSGD's periodic pull, as in the official code: ``x ← (1 − c) x + c x̃``."""
    if not 0.0 <= pull <= 1.0:
        raise ValueError(f"pull must be in [0, 1] (got {pull})")
    return ((1.0 - pull) * x.to(torch.float64) + pull * leader_x.to(torch.float64)).to(x.dtype)


# -- Swarm Learning (§16) --------------------------------------------------------------
def merge_leader(ids: Sequence[str], round: int) -> str:
    """This round's leader: deterministic from the round and the sorted live members, so
    every peer elects the same one and the role rotates; if it dies the round times out
    and the next round has the next leader."""
    ids = sorted(ids)
    return ids[round % len(ids)]


def weighted_merge(models: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """``θ = Σ_k w_k θ_k / Σ_k w_k`` (Swarm Learning's "mean" merge; w_k = sample count),
    accumulated in float64."""
    if len(models) != len(weights) or not models:
        raise ValueError("need as many weights as models, at least one")
    w = torch.tensor(weights, dtype=torch.float64)
    if (w < 0).any() or float(w.sum()) <= 0:
        raise ValueError("merge weights must be >= 0 with a positive sum")
    X = torch.stack([m.reshape(-1).to(torch.float64) for m in models])
    return ((w / w.sum()) @ X).to(torch.float32)


# -- SQuARM-SGD (§7) -------------------------------------------------------------------
class SquarmNode:
    """One node of SQuARM-SGD::

        v ← β v + g;  x ← x − η (β v + g)                        (H Nesterov steps)
        if ‖x − x̂_i‖² > c·η²:  q_i = C(x − x̂_i)  else  q_i = 0   (event trigger)
        x̂_j ← x̂_j + q_j  for j ∈ N(i) ∪ {i}
        x ← x + γ Σ_j w_ij (x̂_j − x̂_i)

    State: ``x``, ``v``, ``x̂_i`` and one ``x̂_j`` per neighbour. A new neighbour (after a
    membership change) is synchronised by sending ``x̂_i`` in full once.
    """

    def __init__(self, x0: torch.Tensor, momentum: float = 0.9, gamma: float = 0.5, threshold: float = 0.0):
        self.x = x0.detach().reshape(-1).to(torch.float32).clone()
        self.v = torch.zeros_like(self.x)
        self.x_hat = self.x.clone()
        self.nbr_hat: dict[str, torch.Tensor] = {}
        self.momentum, self.gamma, self.threshold = float(momentum), float(gamma), float(threshold)

    def nesterov_step(self, g: torch.Tensor, lr: float) -> None:
        self.v = self.momentum * self.v + g
        self.x = self.x - lr * (self.momentum * self.v + g)

    def triggered(self, lr: float) -> bool:
        return float((self.x - self.x_hat).pow(2).sum()) > self.threshold * lr * lr

    def consensus(self, weights: Mapping[str, float], self_id: str) -> None:
        """``x ← x + γ Σ_j w_ij (x̂_j − x̂_i)`` over the neighbours whose copy we hold."""
        acc = torch.zeros_like(self.x, dtype=torch.float64)
        for j, w in weights.items():
            if j != self_id and j in self.nbr_hat:
                acc += w * (self.nbr_hat[j].to(torch.float64) - self.x_hat.to(torch.float64))
        self.x = (self.x.to(torch.float64) + self.gamma * acc).to(torch.float32)

    def state_dict(self) -> dict:
        return {"x": self.x, "v": self.v, "x_hat": self.x_hat, "nbr_hat": dict(self.nbr_hat)}

    def load_state_dict(self, s: dict) -> None:
        self.x, self.v, self.x_hat, self.nbr_hat = s["x"], s["v"], s["x_hat"], dict(s["nbr_hat"])
