"""Prague's math: Partial All-Reduce among groups (docs/algorithms.md §5). The event loop that
forms the groups and drives it on the virtual clock is :mod:`fedswarm.sim.async_groups`."""

from __future__ import annotations

from typing import Sequence

import torch

from fedswarm.algorithms.decentralized.adpsgd import check_schedule
from fedswarm.algorithms.decentralized.base import DecentralizedAlgorithm, GossipState

__all__ = ["Prague", "partial_allreduce"]


def partial_allreduce(x: torch.Tensor, group: Sequence[int]) -> torch.Tensor:
    """P-Reduce: ``x_i ← (1/|G|) Σ_{j∈G} x_j`` for ``i ∈ G`` (a doubly stochastic W with a
    ``|G|×|G|`` block of ``1/|G|``); returns a new ``[n, d]`` tensor, the mean is kept."""
    idx = torch.as_tensor(list(group), dtype=torch.long)
    if idx.numel() < 1 or idx.unique().numel() != idx.numel():
        raise ValueError(f"a group needs distinct members, got {list(group)}")
    if int(idx.min()) < 0 or int(idx.max()) >= x.shape[0]:
        raise ValueError(f"group {list(group)} names nodes outside 0..{x.shape[0] - 1}")
    out = x.clone()
    out[idx] = x[idx].to(torch.float64).mean(dim=0).to(x.dtype)
    return out


class Prague(DecentralizedAlgorithm):
    """Prague (Luo, He, Zhuo, Qian, ASPLOS 2020; docs/algorithms.md §5). Each worker loops::

        x_i ← x_i − η ∇F_i(x_i; ξ)            # local SGD step
        G   ← GroupGenerator.request(i)        # i ∈ G
        x_j ← (1/|G|) Σ_{k∈G} x_k  for j ∈ G   # Partial All-Reduce, blocks G only

    The group generator of the simulator (``fedswarm.sim.async_groups``) is
    heterogeneity-aware in the simplest way: it groups the ``group_size`` workers that
    have finished their step first, so a fast worker never waits for one still
    computing (a reconstruction: the paper's exact policy is not known, §5 [?]).
    ``group_size = n`` is synchronous all-reduce SGD.

    In matrix form ``X ← W_k (X − η G)`` with ``W_k`` the groups' block averages, so the
    generic ``local_step`` + :meth:`mix` is one Prague iteration: how the runtimes drive a
    fixed schedule (``schedule="fixed"``, :mod:`.schedule`: seeded groups per tick and
    gradients up to ``max_staleness`` iterations stale).

    State: ``x`` and ``max_staleness`` earlier models (the group generator holds a queue
    of ready workers). Wire: a ring all-reduce within the group: ``2(g−1)/g · 4d`` bytes
    sent per member per P-Reduce, about one P-Reduce per local step (under a fixed
    schedule the runtimes exchange models directly, ``(g−1)·4d`` per member).
    """

    name = "prague"

    def __init__(self, group_size: int = 4, schedule: str = "clock", max_staleness: int = 0,
                 weight_decay: float = 0.0):
        super().__init__(weight_decay)
        if int(group_size) < 2:
            raise ValueError(f"group_size must be >= 2 (got {group_size})")
        self.group_size = int(group_size)
        self.schedule, self.max_staleness = check_schedule(self.name, schedule, max_staleness)

    def _init_buffers(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return self._snapshot_buffers(x)

    def local_step(self, state: GossipState, grads: torch.Tensor, lr: float) -> None:
        self._remember(state)
        state.x = state.x - lr * self._grad(state, grads)
        state.step += 1

    def _finish(self, state: GossipState, mixed: torch.Tensor) -> None:
        state.x = mixed  # a P-Reduce is not an iteration: step counts local steps

    def group_average(self, state: GossipState, group: Sequence[int]) -> None:
        state.x = partial_allreduce(state.x, group)

    def wire_bytes(self, d: int, degree: int) -> int:
        """Bytes a member sends per P-Reduce (ring all-reduce in a group of ``group_size``)."""
        g = self.group_size
        return int(round(2 * (g - 1) / g * 4 * d))

    def hyperparams(self):
        return {"group_size": self.group_size, "schedule": self.schedule, "max_staleness": self.max_staleness,
                **super().hyperparams()}
