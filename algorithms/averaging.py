"""FedAvg's aggregate, once for every runtime: the weighted mean of the clients' vectors.

``sum_k w_k x_k / sum_k w_k`` (McMahan et al. 2017, ``w_k`` the client's examples), summed in
float64 a chunk of clients at a time. The Flower strategy
(:class:`~fedswarm.strategies.federated.fedavg.CheckedFedAvg`) adds the round's replies; the
batched engine (:mod:`fedswarm.sim.batched`) adds each chunk's weighted sum as it leaves the
trainer, so it never holds every client's model.
"""

from __future__ import annotations

import torch

__all__ = ["WeightedSum"]


class WeightedSum:
    """A running ``sum_k w_k x_k`` (``total``, float64 ``[d]``) and ``sum_k w_k`` (``weight``)."""

    def __init__(self, d: int):
        self.total = torch.zeros(d, dtype=torch.float64)
        self.weight = 0.0

    def add(self, x: torch.Tensor, w: torch.Tensor) -> None:
        """Clients ``x [C, d]`` with weights ``w [C]``: their weighted sum is taken in ``x``'s
        dtype (one product, as the batched engine takes a chunk's), then added in float64."""
        self.add_sum(w.to(x.device, x.dtype) @ x, float(w.sum()))

    def add_sum(self, part: torch.Tensor, weight: float) -> None:
        """A weighted sum ``[d]`` of clients whose weights sum to ``weight``."""
        self.total += part.cpu().to(torch.float64)
        self.weight += weight

    def mean(self) -> torch.Tensor:
        """The weighted mean, float32 ``[d]``; ValueError when no weight was added."""
        if self.weight == 0:
            raise ValueError("WeightedSum.mean: no client has weight (nothing to average)")
        return (self.total / self.weight).to(torch.float32)
