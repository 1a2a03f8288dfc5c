"""PVT's schedule: which variables a node trains in a round (Yang et al., ICASSP 2022).

Node and server both derive node ``c``'s subset ``T_c`` of the model's ``V`` tensors from
the run seed, the round and the node id, so the ids need not travel
(:class:`fedswarm.strategies.edge.pvt.PartialVariableTraining` explains the algorithm)::

    k   = max(1, round(f·V))
    T_c = the first k of a permutation of 0..V-1 drawn from seed(run seed, t, node id)
"""

from __future__ import annotations

import torch

__all__ = ["selection_seed", "select_variables", "num_selected"]


def selection_seed(seed: int, server_round: int, node_id: int) -> int:
    """The seed of one node's variable subset in one round; node and server both know it."""
    return (seed * 1_000_003 + server_round * 7_919 + int(node_id) * 104_729 + 17) % (2**31 - 1)


def select_variables(num_variables: int, k: int, seed: int) -> torch.Tensor:
    """``k`` of ``num_variables`` tensor ids, uniformly at random from ``seed``, sorted
    (int64). The first ``k`` of one permutation: any ``k`` gives a prefix of the same
    order, so the server re-derives a node's subset from (seed, k) alone."""
    if not 1 <= k <= num_variables:
        raise ValueError(f"k must be in 1..{num_variables}, got {k}")
    g = torch.Generator().manual_seed(int(seed))
    return torch.randperm(num_variables, generator=g)[:k].sort().values


def num_selected(num_variables: int, fraction: float) -> int:
    """``k = round(f·V)``, at least 1."""
    return min(num_variables, max(1, round(fraction * num_variables)))
