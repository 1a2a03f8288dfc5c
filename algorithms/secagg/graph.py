"""SecAgg+'s communication graph: each node shares its secrets with, and masks against, only
its ``k`` neighbours.

The graph is the Harary graph ``H(k, n)`` (a ring where each node links to the ``k/2``
nearest on each side: ``k``-regular, ``k`` even) over a random permutation of the nodes,
the permutation drawn from the server's round seed, as in Bell et al. (CCS 2020). For
``k >= n - 1`` it is the complete graph (SecAgg). The default degree is the complete graph
up to 20 nodes and the smallest even ``k >= 3*log2(n)`` above: O(log n) neighbours, a
heuristic in the spirit of the paper, not its exact constants.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["default_degree", "neighbours"]

_FULL_UP_TO = 20


def default_degree(n: int) -> int:
    """The number of neighbours each of ``n`` nodes gets by default."""
    if n <= _FULL_UP_TO:
        return max(n - 1, 0)
    k = math.ceil(3 * math.log2(n))
    return min(n - 1, k + (k % 2))


def neighbours(node_ids: Sequence[int], degree: int, seed: int) -> dict[int, list[int]]:
    """Each node's neighbours (sorted, itself excluded) in the ``degree``-regular graph drawn
    from ``seed``. An odd degree below ``n - 1`` is rounded up to the next even one."""
    ids = sorted(int(i) for i in node_ids)
    n = len(ids)
    if len(set(ids)) != n:
        raise ValueError("secagg graph: node ids must be distinct")
    if degree < 1 and n > 1:
        raise ValueError(f"secagg graph: degree must be >= 1, got {degree}")
    if degree >= n - 1:
        return {i: [j for j in ids if j != i] for i in ids}
    half = (degree + 1) // 2
    order = [ids[p] for p in np.random.default_rng(seed).permutation(n)]
    out: dict[int, set[int]] = {i: set() for i in ids}
    for pos, node in enumerate(order):
        for step in range(1, half + 1):
            other = order[(pos + step) % n]
            out[node].add(other)
            out[other].add(node)
    return {i: sorted(out[i]) for i in ids}
