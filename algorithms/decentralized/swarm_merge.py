"""Swarm Learning's merge (Warnat-Herresthal et al., Nature 2021; docs/algorithms.md §16).

Each round one elected peer collects every member's model and merges them by a
sample-weighted mean; the swarm driver (:mod:`fedswarm.swarm.drivers`) only routes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["merge_leader", "weighted_merge"]


def merge_leader(ids: Sequence[str], round: int) -> str:
    """This round's merge leader: deterministic from the round and the sorted live members,
    so every peer elects the same one and the role rotates; if it dies the round times out
    and the next round has the next leader."""
    if not ids:
        raise ValueError("no members to elect a merge leader from")
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
