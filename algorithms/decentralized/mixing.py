"""Gossip (mixing) matrices: the checks and weights every topology uses.

``W`` must be symmetric, doubly stochastic and nonnegative, with ``W_ij > 0`` only for
``i == j`` or an edge (Lian et al. 2017, ``docs/algorithms.md`` §2). Weights are
Metropolis–Hastings, ``w_ij = 1 / (1 + max(deg_i, deg_j))`` on edges and
``w_ii = 1 − Σ_j w_ij`` (as decentralizepy does); on a regular graph this is the uniform
``1 / (deg + 1)``. How fast gossip averages is governed by the spectral gap
``1 − max(|λ₂|, |λ_n|)``: with zero learning rate ``‖X_t − X̄‖ ≤ (1 − gap)^t ‖X_0 − X̄‖``.
"""

from __future__ import annotations

import torch

__all__ = ["check_mixing", "metropolis_hastings", "spectral_gap"]


def check_mixing(W: torch.Tensor, atol: float = 1e-8) -> None:
    """Check that ``W`` is a valid gossip matrix: square, symmetric, nonnegative and
    doubly stochastic (rows and columns sum to 1). Raise ValueError naming what fails."""
    if W.ndim != 2 or W.shape[0] != W.shape[1]:
        raise ValueError(f"mixing matrix must be square [n, n], got shape {tuple(W.shape)}")
    W = W.to(torch.float64)
    if not torch.isfinite(W).all():
        raise ValueError("mixing matrix has non-finite entries")
    asym = (W - W.T).abs().max().item() if W.numel() else 0.0
    if asym > atol:
        raise ValueError(f"mixing matrix is not symmetric: max |W_ij - W_ji| = {asym:.3g}")
    low = W.min().item() if W.numel() else 0.0
    if low < -atol:
        raise ValueError(f"mixing matrix is not nonnegative: min entry = {low:.3g}")
    for axis, what in ((1, "row"), (0, "column")):
        err = (W.sum(dim=axis) - 1.0).abs()
        if W.numel() and err.max().item() > atol:
            k = int(err.argmax())
            raise ValueError(
                f"mixing matrix is not doubly stochastic: {what} {k} sums to "
                f"{W.sum(dim=axis)[k].item():.6g}, not 1"
            )


def metropolis_hastings(adjacency: torch.Tensor) -> torch.Tensor:
    """Metropolis–Hastings weights of an undirected graph, float64 ``[n, n]``:
    ``w_ij = 1/(1 + max(deg_i, deg_j))`` on edges, the rest on the diagonal. Equals the
    uniform ``1/(deg + 1)`` on a regular graph."""
    A = adjacency.to(torch.float64)
    deg = A.sum(dim=1)
    W = A / (1.0 + torch.maximum(deg[:, None], deg[None, :]))
    return W + torch.diag(1.0 - W.sum(dim=1))


def spectral_gap(W: torch.Tensor) -> float:
    """``1 − max(|λ₂|, |λ_n|)`` of a symmetric ``W`` (1 for a single node; 0 when the graph
    is disconnected, because then λ₂ = 1)."""
    if W.shape[0] == 1:
        return 1.0
    moduli = torch.linalg.eigvalsh(W.to(torch.float64)).abs().sort(descending=True).values
    return float(1.0 - moduli[1])
