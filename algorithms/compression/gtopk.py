"""gTop-k's math (Shi et al., ICDCS 2019): the clients' accumulators on a leading client axis
and the server's merges of sparse vectors. Plain torch; the strategy that runs it on Flower
and on the batched engine is :mod:`fedswarm.strategies.federated.gtopk`.

A sparse vector is ``(indices, values)``: int64 indices ascending, float values of one length.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["merge_topk", "tree_merge", "accumulate"]

Sparse = tuple[torch.Tensor, torch.Tensor]


def merge_topk(a: Sparse, b: Sparse, k: int) -> Sparse:
    """One gTop-k merge: sum the values of two sparse vectors on the union of their
    indices and keep the ``k`` of largest magnitude (indices ascending)."""
    idx = torch.cat([a[0], b[0]])
    vals = torch.cat([a[1], b[1]])
    union, inverse = torch.unique(idx, return_inverse=True)
    sums = torch.zeros(union.numel(), dtype=vals.dtype).index_add_(0, inverse, vals)
    if union.numel() > k:
        keep = sums.abs().topk(k).indices.sort().values
        union, sums = union[keep], sums[keep]
    return union, sums


def tree_merge(parts: list[Sparse], k: int) -> Sparse:
    """gTop-k's recursive-doubling reduction of P sparse vectors: at each of ceil(log2 P)
    levels, neighbours (0,1), (2,3), ... are merged with :func:`merge_topk`; an odd one
    out passes up unchanged. Entries dropped at a level are lost to that round (they stay
    in their workers' residuals), as in the reference ``gtopkssgd/allreducer.py``."""
    level = list(parts)
    while len(level) > 1:
        level = [merge_topk(level[i], level[i + 1], k) if i + 1 < len(level) else level[i]
                 for i in range(0, len(level), 2)]
    return level[0]


def accumulate(acc: torch.Tensor, taken: Sequence[torch.Tensor | None], delta: torch.Tensor) -> torch.Tensor:
    """The accumulators of C clients for this round: ``acc`` ``[C, d]`` with, in row ``i``,
    the coordinates ``taken[i]`` (those of the client's last message the server used; None:
    none) cleared, plus its model change ``delta[i]``. Returns a new tensor."""
    if acc.dim() != 2 or acc.shape != delta.shape or len(taken) != acc.shape[0]:
        raise ValueError(f"accumulate takes acc and delta [C, d] and C index sets; got {tuple(acc.shape)}, "
                         f"{tuple(delta.shape)} and {len(taken)}")
    out = acc.clone()
    for i, idx in enumerate(taken):
        if idx is not None:
            out[i, idx] = 0.0
    return out.add_(delta)
