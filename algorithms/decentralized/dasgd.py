"""DaSGD: local SGD with delayed averaging (docs/algorithms.md §10)."""

from __future__ import annotations

from typing import Any

import torch

from fedswarm.algorithms.decentralized.base import DecentralizedAlgorithm, GossipState

__all__ = ["DaSGD"]


class DaSGD(DecentralizedAlgorithm):
    """DaSGD, local SGD with delayed averaging (Zhou et al., arXiv:2006.00441; the update
    is docs/algorithms.md §10's *reconstruction*, the DGA-style merge, not verified paper text)::

        x_i ← x_i − η g_i                                   every step t
        at t0 with (t0+1) % τ == 0:  s_i ← x_i; launch s̄_i = Σ_j W_ij s_j (non-blocking)
        at t0 + δ:                    x_i ← x_i + (s̄_i − s_i)

    i.e. the average computed at step ``t0`` is applied ``δ`` (``delay``) steps later, and
    the ``δ`` local steps taken meanwhile are kept. With ``W = 11ᵀ/n`` (topology
    ``complete``) ``s̄`` is the all-reduce average, the paper's setting; any other W gives
    delayed gossip. ``delay = 0`` is local SGD with periodic averaging (and with
    ``period = 1`` D-PSGD "atc"). ``delay < period`` is required, so at most one averaging
    is in flight. With a doubly stochastic W the corrections sum to zero over nodes, so the
    node average moves only by the SGD steps.

    State: ``x``, the snapshot's correction ``s̄ − s`` waiting to be applied (2d floats),
    the step it is due.
    Wire: one model every τ steps: ``4d·deg`` bytes (a ring all-reduce instead costs
    ``2(P−1)/P·4d``); ``meta["wire_bytes"]`` counts ``4d·deg`` per node per averaging.
    """

    name = "dasgd"

    def __init__(self, period: int = 4, delay: int = 1, weight_decay: float = 0.0):
        super().__init__(weight_decay)
        if int(period) < 1:
            raise ValueError(f"period must be >= 1 (got {period})")
        if not 0 <= int(delay) < int(period):
            raise ValueError(f"delay must be in [0, period) = [0, {period}) (got {delay})")
        self.period, self.delay = int(period), int(delay)

    def _init_buffers(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"pending": torch.zeros_like(x)}

    def init_state(self, x0: torch.Tensor) -> GossipState:
        state = super().init_state(x0)
        state.meta.update({"due": -1.0, "wire_bytes": 0.0})
        return state

    def is_sync(self, step: int) -> bool:
        return (step + 1) % self.period == 0

    def local_step(self, state: GossipState, grads: torch.Tensor, lr: float) -> None:
        state.x = state.x - lr * self._grad(state, grads)

    def message(self, state: GossipState) -> torch.Tensor:
        return state.x  # the snapshot s_i on a sync step (ignored otherwise)

    def mix(self, state: GossipState, received: torch.Tensor, W: torch.Tensor) -> None:
        if self.is_sync(state.step):
            off = (W != 0).to(torch.int64)
            deg = off.sum() - torch.diagonal(off).sum()
            state.meta["wire_bytes"] = state.meta.get("wire_bytes", 0.0) + 4.0 * state.d * float(deg)
        super().mix(state, received, W)

    def node_mix(self, state, i, received, weights) -> None:
        if self.is_sync(state.step):
            state.meta["wire_bytes"] = state.meta.get("wire_bytes", 0.0) + 4.0 * state.d * len(received)
        super().node_mix(state, i, received, weights)

    def _finish(self, state: GossipState, mixed: torch.Tensor) -> None:
        t = state.step
        x = state.x
        if self.is_sync(t):  # the snapshot is x itself (message == x on this step)
            state.buffers["pending"] = mixed - x
            state.meta["due"] = float(t + self.delay)
        if state.meta.get("due", -1.0) == float(t):
            x = x + state.buffers["pending"]
            state.buffers["pending"] = torch.zeros_like(x)
            state.meta["due"] = -1.0
        super()._finish(state, x)

    def wire_bytes(self, d: int, degree: int) -> int:
        return 4 * d * degree // self.period

    def hyperparams(self) -> dict[str, Any]:
        return {"period": self.period, "delay": self.delay, **super().hyperparams()}
