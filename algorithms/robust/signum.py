"""signSGD with majority vote (the aggregation of Signum).

Each worker sends ``sign(v_i)`` (1 bit a coordinate); the server returns the elementwise
majority ``sign(Σ_i sign(v_i))`` (1 bit a coordinate; a tie gives 0, no move) and
everyone steps ``x ← x − η · vote`` (with ``v_i`` a descent direction) or, as here with
client model changes ``δ_i``, ``x ← x + η · sign(Σ_i sign(δ_i))``.

State: none on the server (Signum's momentum lives on the workers; fedswarm's clients
send the sign of their local model change, which already averages their local steps, so
the momentum is β = 0 — signSGD-MV). Wire: ceil(d/8) bits up and down, plus a scale.

Tolerance: majority vote survives fewer than half the workers being Byzantine *when the
adversaries are blind* (they cannot see the honest votes); Bernstein et al. 2019,
Theorem 2. An omniscient minority can still flip every coordinate whose honest vote is
closer than its own size: :mod:`.attacks`' ``signvote`` does exactly that.

Paper: Bernstein, Zhao, Azizzadenesheli, Anandkumar, "signSGD with Majority Vote is
Communication Efficient and Fault Tolerant", ICLR 2019.
"""

from __future__ import annotations

import torch

from fedswarm.algorithms.robust.aggregators import RobustRule

__all__ = ["MajorityVote"]


class MajorityVote(RobustRule):
    """``sign(Σ_i sign(x_i))`` over the client axis (sign(0) = 0)."""

    name, paper, bound = "signum", "Bernstein et al., ICLR 2019", "f < n/2 (blind adversaries)"

    @staticmethod
    def max_byzantine(n: int) -> int:
        return (n - 1) // 2

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = self._input(x)
        return torch.sign(torch.sign(x).sum(dim=0))
