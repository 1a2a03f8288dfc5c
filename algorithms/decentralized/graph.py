"""The :class:`Topology` object: who talks to whom at a round, and with what weights.

Builders of the standard graphs are in :mod:`.graphs`; specs (``make_topology``) in
:mod:`.topology`, which re-exports everything (import from there).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Iterable

import torch

from fedswarm.algorithms.decentralized.mixing import metropolis_hastings, spectral_gap

__all__ = ["Topology", "OnePeerExponential"]


class Topology:
    """An undirected communication graph on ``n`` nodes, possibly changing with the round.

    Parameters
    ----------
    name : str
        The spec it was made from (``"ring"``, ``"torus:4x4"``, ...), for logs.
    adjacency : torch.Tensor
        Boolean ``[n, n]``, symmetric, no self loops. Static topologies only; time-varying
        ones override :meth:`adjacency`.
    lazy : bool
        Mix with ``(I + W) / 2`` instead of ``W``.

    Attributes
    ----------
    n : int
        Number of nodes.
    time_varying : bool
        Whether the graph depends on the round.
    period : int
        The graph at round ``t`` equals the graph at ``t + period`` (1 when static).
    """

    time_varying: bool = False
    period: int = 1

    def __init__(self, name: str, adjacency: torch.Tensor | None, *, lazy: bool = False):
        self.name = name
        self.lazy = lazy
        self._adjacency = None
        if adjacency is not None:
            A = adjacency.to(torch.bool)
            if A.ndim != 2 or A.shape[0] != A.shape[1]:
                raise ValueError(f"adjacency must be [n, n], got {tuple(A.shape)}")
            if not torch.equal(A, A.T):
                raise ValueError("adjacency must be symmetric (undirected graph)")
            if A.diagonal().any():
                raise ValueError("adjacency must have no self loops")
            self._adjacency = A
            self.n = A.shape[0]
        self._W_cache: dict[int, torch.Tensor] = {}

    # -- graph
    def adjacency(self, round: int = 0) -> torch.Tensor:
        """Boolean ``[n, n]`` adjacency at ``round``."""
        return self._adjacency

    def neighbors(self, i: int, round: int = 0) -> list[int]:
        """Sorted neighbours of node ``i`` at ``round`` (never ``i`` itself)."""
        return torch.nonzero(self.adjacency(round)[i]).flatten().tolist()

    def degrees(self, round: int = 0) -> torch.Tensor:
        """Degree of every node at ``round``, int64 ``[n]``."""
        return self.adjacency(round).sum(dim=1)

    def edges(self, round: int = 0) -> list[tuple[int, int]]:
        """Undirected edges ``(i, j)`` with ``i < j`` at ``round``."""
        return [tuple(e) for e in torch.nonzero(torch.triu(self.adjacency(round), 1)).tolist()]

    def is_connected(self, round: int = 0) -> bool:
        return not _unreachable(self.adjacency(round))

    # -- weights
    def mixing_matrix(self, round: int = 0) -> torch.Tensor:
        """The gossip matrix at ``round``, float64 ``[n, n]`` (Metropolis–Hastings, lazy
        if asked). Cached; do not modify the returned tensor."""
        key = round % self.period
        W = self._W_cache.get(key)
        if W is None:
            W = metropolis_hastings(self.adjacency(round))
            if self.lazy:
                W = 0.5 * (torch.eye(self.n, dtype=torch.float64) + W)
            self._W_cache[key] = W
        return W

    def weights(self, i: int, round: int = 0) -> dict[int, float]:
        """Row ``i`` of the mixing matrix as ``{j: w_ij}`` over ``i`` and its neighbours:
        what one peer needs to mix what it received."""
        row = self.mixing_matrix(round)[i]
        return {j: float(row[j]) for j in [i, *self.neighbors(i, round)]}

    def staleness(self, i: int, round: int = 0) -> int:
        """How many iterations old node ``i``'s gradient model is at ``round``: 0 for a
        graph; a fixed schedule (:mod:`.schedule`) replays an asynchronous run's."""
        return 0

    def spectral_gap(self, round: int = 0) -> float:
        """``1 − max(|λ₂(W)|, |λ_n(W)|)`` at ``round``. For a time-varying topology one
        round's graph may be disconnected (gap 0); the gossip mixes over a period."""
        return spectral_gap(self.mixing_matrix(round))

    def summary(self) -> str:
        deg = self.degrees(0)
        kind = "time-varying" if self.time_varying else "static"
        return (
            f"{self.name}: n={self.n}, {kind}, degree {int(deg.min())}..{int(deg.max())}, "
            f"spectral gap {self.spectral_gap(0):.4f}"
        )

    def __repr__(self) -> str:
        return f"Topology({self.name!r}, n={self.n}{', lazy' if self.lazy else ''})"


class OnePeerExponential(Topology):
    """Time-varying one-peer exponential graph: at round ``t`` node ``i`` talks to
    ``i ± 2^(t mod τ)`` with ``τ = ⌈log₂ n⌉`` (degree 2, or 1 when the distance is n/2).
    One round's graph is sparse and may be disconnected; a period of τ rounds reaches
    everyone (cf. Ying et al., NeurIPS 2021, here undirected so W stays symmetric)."""

    time_varying = True

    def __init__(self, n: int, *, lazy: bool = False):
        super().__init__("onepeer-exp", None, lazy=lazy)
        self.n = n
        self.period = max(1, math.ceil(math.log2(n))) if n > 1 else 1
        self._A_cache: dict[int, torch.Tensor] = {}

    def distance(self, round: int) -> int:
        """The hop distance ``2^(round mod τ)`` used at ``round``."""
        return 2 ** (round % self.period)

    def adjacency(self, round: int = 0) -> torch.Tensor:
        key = round % self.period
        A = self._A_cache.get(key)
        if A is None:
            A = _circulant(self.n, [self.distance(round)]) if self.n > 1 else _empty(self.n)
            self._A_cache[key] = A
        return A


# --------------------------------------------------------------------------- adjacency helpers


def _empty(n: int) -> torch.Tensor:
    return torch.zeros(n, n, dtype=torch.bool)


def _circulant(n: int, offsets: Iterable[int]) -> torch.Tensor:
    """Adjacency with edges ``i — i ± k (mod n)`` for each offset k."""
    A = _empty(n)
    idx = torch.arange(n)
    for k in offsets:
        for j in ((idx + k) % n, (idx - k) % n):
            A[idx, j] = True
    A.fill_diagonal_(False)
    return A


def _from_pairs(n: int, pairs: Iterable[tuple[int, int]]) -> torch.Tensor:
    A = _empty(n)
    pairs = list(pairs)
    if pairs:
        p = torch.tensor(pairs, dtype=torch.long)
        A[p[:, 0], p[:, 1]] = True
        A[p[:, 1], p[:, 0]] = True
    return A


def _unreachable(A: torch.Tensor) -> list[int]:
    """Nodes not reachable from node 0 (breadth-first search)."""
    n = A.shape[0]
    if n == 0:
        return []
    nbrs = [torch.nonzero(A[i]).flatten().tolist() for i in range(n)]
    seen = [False] * n
    seen[0] = True
    queue = deque([0])
    while queue:
        i = queue.popleft()
        for j in nbrs[i]:
            if not seen[j]:
                seen[j] = True
                queue.append(j)
    return [i for i in range(n) if not seen[i]]
